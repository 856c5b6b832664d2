"""What a run says in its log (rank 0), for a user reading a SLURM .out file: the start banner, and the
megatron-core / apex / transformer-engine warnings kept out of it (library_warnings.py: RUN_DIR/warnings.log, one
summary line).

    LIBRARY_WARNINGS.install()                               # before megatron-core is imported
    library = LIBRARY_WARNINGS.attach(run_dir, enabled=rank == 0)
    print(start_banner(cfg, model_cfg, world, step))
    print(library.summary())                                 # "[megatron-spo] 7 library warnings suppressed, ..."
    library.close()
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

from megatron_spo.library_warnings import LIBRARY_WARNINGS  # noqa: F401 (the trainer's, imported from here)


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
