"""What a run says in its log (rank 0), for a user reading a SLURM .out file: the start banner, and the
megatron-core / apex / transformer-engine warnings kept out of it (RUN_DIR/warnings.log, one summary line).

    LIBRARY_WARNINGS.install()                               # before megatron-core is imported
    library = LIBRARY_WARNINGS.attach(run_dir, enabled=rank == 0)
    print(start_banner(cfg, model_cfg, world, step))
    print(library.summary())                                 # "[megatron-spo] 7 library warnings suppressed, ..."
    library.close()
"""

from __future__ import annotations

import platform
import warnings
from importlib import metadata
from pathlib import Path

# warnings raised from these packages' files: fallbacks and deprecations the user cannot act on
LIBRARY_PATHS = ("/megatron/core/", "/apex/", "/transformer_engine/")
WARNINGS_FILE = "warnings.log"


class LibraryWarnings:
    """Routes warnings raised in LIBRARY_PATHS to RUN_DIR/warnings.log (rank 0; other ranks drop them) and
    counts them; every other warning is shown as before. Until attach() names the run directory they are kept
    in memory: megatron-core warns when its modules are first imported, before any trainer exists."""

    def __init__(self):
        self.path: Path | None = None
        self.enabled = True
        self.count = 0
        self._reported = 0
        self._buffer: list[str] = []
        self._previous = None

    def install(self) -> LibraryWarnings:
        if self._previous is None:
            self._previous = warnings.showwarning
            warnings.showwarning = self._show
        return self

    def attach(self, run_dir: str | Path, *, enabled: bool) -> LibraryWarnings:
        """From now on write to RUN_DIR/warnings.log (if enabled), starting with the ones kept so far."""
        self.path, self.enabled = Path(run_dir) / WARNINGS_FILE, enabled
        self.count, self._reported = len(self._buffer), 0
        if enabled and self._buffer:
            self._write("".join(self._buffer))
        self._buffer.clear()
        return self.install()

    def _write(self, text: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(text)

    def _show(self, message, category, filename, lineno, file=None, line=None):
        if not any(p in str(filename).replace("\\", "/") for p in LIBRARY_PATHS):
            return self._previous(message, category, filename, lineno, file, line)
        text = warnings.formatwarning(message, category, filename, lineno, line)
        if self.path is None:
            self._buffer.append(text)
            return None
        self.count += 1
        if self.enabled:
            self._write(text)
        return None

    def summary(self) -> str | None:
        """One line for the warnings since the last summary, or None when there were none."""
        new, self._reported = self.count - self._reported, self.count
        if not new or not self.enabled:
            return None
        more = "more " if self._reported > new else ""
        return f"[megatron-spo] {new} {more}library warning{'s' * (new != 1)} suppressed, see {self.path}"

    def close(self) -> None:
        """Show warnings as before again; the next run's attach() installs this again."""
        if self._previous is not None and warnings.showwarning == self._show:
            warnings.showwarning = self._previous
        self._previous, self.path = None, None


# The process's one instance: installed when the trainer module is imported (training/trainer.py).
LIBRARY_WARNINGS = LibraryWarnings()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def parameter_count(model_cfg) -> int | None:
    """The model's parameters (ModelConfig.stage_parameters: one whole model, vocabulary padded), None if it
    cannot tell."""
    try:
        return model_cfg.stage_parameters(1, 1)
    except Exception:  # a model the planner does not know: the banner says '?'
        return None


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def start_banner(cfg, model_cfg, world_size: int, step: int) -> str:
    """Four lines: the run, the model, the layout, the versions."""
    p = cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    init = ", ".join(f"{k} {v}" for k, v in (("megatron", cfg.init.megatron), ("hf", cfg.init.hf)) if v) or "random"
    start = f"resuming at step {step}" if step else "from step 0"
    arch = getattr(model_cfg, "architecture", "llama")
    return "\n".join([
        f"[megatron-spo] train: algo {cfg.algo}, {cfg.steps} steps ({start}), run dir {Path(cfg.run_dir).resolve()}",
        f"[megatron-spo] model: {arch}, {model_cfg.num_layers} layers, hidden {model_cfg.hidden_size}, "
        f"{_human(parameter_count(model_cfg))} parameters, {model_cfg.params_dtype}; init from {init}",
        f"[megatron-spo] layout: {world_size} rank(s) = TP {tp} x PP {pp} x "
        f"{f'CP {p.context_parallel_size} x ' if p.context_parallel_size > 1 else ''}DP {p.data_parallel_size(world_size)}"
        f"{f' (VPP {p.virtual_pipeline_model_parallel_size})' if p.virtual_pipeline_model_parallel_size else ''}, "
        f"sequence parallel {'on' if p.sequence_parallel else 'off'}, distributed optimizer "
        f"{'on' if p.use_distributed_optimizer else 'off'}",
        f"[megatron-spo] versions: megatron-core {_version('megatron-core')}, torch {_version('torch')}, "
        f"transformers {_version('transformers')}, megatron-spo {_version('megatron-spo')}, "
        f"python {platform.python_version()}",
    ])
