"""megatron-core / apex / transformer-engine warnings kept out of a command's output: written to a file and
counted in one summary line (`train`: RUN_DIR/warnings.log, training/run_log.py; `convert`: beside its output).

    LIBRARY_WARNINGS.install()                               # before megatron-core is imported
    library = LIBRARY_WARNINGS.attach(run_dir, enabled=rank == 0)
    print(library.summary())                                 # "[megatron-spo] 7 library warnings suppressed, ..."
    library.close()
"""

from __future__ import annotations

import warnings
from pathlib import Path

# warnings raised from these packages' files: fallbacks and deprecations the user cannot act on
LIBRARY_PATHS = ("/megatron/core/", "/apex/", "/transformer_engine/")
WARNINGS_FILE = "warnings.log"


class LibraryWarnings:
    """Routes warnings raised in LIBRARY_PATHS to RUN_DIR/warnings.log (rank 0; other ranks drop them), or another
    file a command names, and counts them; every other warning is shown as before. Until attach() names the run
    directory they are kept in memory: megatron-core warns when its modules are first imported, before any trainer
    exists."""

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

    def attach(self, run_dir: str | Path, *, enabled: bool, name: str = WARNINGS_FILE) -> LibraryWarnings:
        """From now on write to RUN_DIR/name (if enabled), starting with the ones kept so far."""
        self.path, self.enabled = Path(run_dir) / name, enabled
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


# The process's one instance: installed when the trainer module is imported (training/trainer.py), and
# by `convert`.
LIBRARY_WARNINGS = LibraryWarnings()
