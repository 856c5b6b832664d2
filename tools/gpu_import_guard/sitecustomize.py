"""Imports as on the GPU machine: what the project imports must be there (CPU runs only).

Python imports this module at start-up when its folder is on PYTHONPATH (tools/gpu_check.py
--simulate-gpu-machine puts it there for every part and every process a part starts). An import made by a
file of the checkout GPU_CHECK_REPO (megatron_spo, tests, tools) of a module of an installed distribution
not named in GPU_CHECK_ALLOWED_DISTS (files of one name a line: the machine's packages, the pinned wheels,
the project) raises ModuleNotFoundError, and importlib.util.find_spec (how optional dependencies are probed)
finds nothing; each refused name is appended to GPU_CHECK_REFUSED_LOG. Imports made by third-party code are
left alone: their packages here are other versions than the machine's, with other needs of their own.
"""

import importlib.abc
import importlib.metadata
import importlib.util
import os
import re
import sys

_SKIPPED_FRAMES = ("<frozen importlib", __file__)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _allowed_dists() -> set[str]:
    names = set()
    for path in os.environ["GPU_CHECK_ALLOWED_DISTS"].split(os.pathsep):
        with open(path) as f:
            names |= {_norm(line.split("==")[0].strip()) for line in f if line.strip() and not line.startswith("#")}
    return names


class _GPUMachineImports(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        allowed = _allowed_dists()
        # top-level module -> its distributions; a module of no allowed distribution is refused
        self.refused = {top for top, dists in importlib.metadata.packages_distributions().items()
                        if not any(_norm(d) in allowed for d in dists)}
        self.refused -= set(sys.stdlib_module_names) | set(sys.builtin_module_names)
        self.log = os.environ.get("GPU_CHECK_REFUSED_LOG")
        self.repo = os.path.realpath(os.environ["GPU_CHECK_REPO"]) + os.sep

    def _from_the_checkout(self) -> bool:
        """Whether the import statement (or find_spec call) being served is in a file of the checkout."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_FRAMES):
            frame = frame.f_back
        if frame is None:
            return False
        path = os.path.realpath(frame.f_code.co_filename)
        # a venv inside the checkout (CI's Python 3.12 leg keeps one under .cache/) holds third-party code
        return path.startswith(self.repo) and f"{os.sep}site-packages{os.sep}" not in path

    def is_refused(self, fullname: str) -> bool:
        top = fullname.partition(".")[0]
        if top not in self.refused or not self._from_the_checkout():
            return False
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{top}\n")
        return True

    def find_spec(self, fullname, path=None, target=None):
        if self.is_refused(fullname):
            raise ModuleNotFoundError(f"No module named '{fullname}' (not on the GPU machine)", name=fullname)
        return None


def _install() -> None:
    finder = _GPUMachineImports()
    sys.meta_path.insert(0, finder)
    original = importlib.util.find_spec

    def find_spec(name, package=None):
        absolute = importlib.util.resolve_name(name, package) if name.startswith(".") else name
        return None if finder.is_refused(absolute) else original(name, package)

    importlib.util.find_spec = find_spec


if os.environ.get("GPU_CHECK_ALLOWED_DISTS"):
    _install()
