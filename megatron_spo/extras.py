"""Optional GPU-only dependencies, each probed exactly once.

A half-installed transformer-engine raises RuntimeError (missing cudnn) rather than ImportError, and
some wheels raise OSError on a missing shared object, so every probe catches all three.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

_PROBE_ERRORS = (ImportError, RuntimeError, OSError)


@functools.cache
def optional_import(name: str) -> ModuleType | None:
    """The module, or None when it is absent or broken on this machine."""
    try:
        return importlib.import_module(name)
    except _PROBE_ERRORS:
        return None


@functools.cache
def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def transformer_engine() -> ModuleType | None:
    """transformer_engine.pytorch when it imports and a GPU is present, else None."""
    if not cuda_available():
        return None
    return optional_import("transformer_engine.pytorch")


def triton() -> ModuleType | None:
    return optional_import("triton")


def wandb() -> ModuleType | None:
    return optional_import("wandb")
