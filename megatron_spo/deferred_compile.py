"""megatron-core's fused functions compiled at their first call, not when megatron-core is imported.

megatron-core decorates its fused functions with ``megatron.core.jit.jit_fuser``, which is ``torch.compile``.
Decorating is lazy in torch (compilation happens at the first call), but the decorator alone imports
torch._dynamo and torch._inductor: ~5 of the ~11 CPU seconds that ``import megatron.core`` costs a process on this
project's 2-core CPU machine, paid by every trainer rank, converter and test process, most of which never call a
fused function (the CPU configs turn the fusions off). ``install()`` (run by ``megatron_spo/__init__``) hooks the
import of ``megatron.core.jit``: when it picks ``torch.compile``, ``jit_fuser`` becomes ``compile_at_first_call``,
which hands the function and the decorator's arguments to ``torch.compile`` on the first call and runs the compiled
function from then on, as before. It does nothing when megatron-core is imported before megatron_spo.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

TARGET = "megatron.core.jit"


def compile_at_first_call(fn: Callable | None = None, **options: Any) -> Callable:
    """``torch.compile(fn, **options)`` made at the first call of ``fn`` (usable as ``@dec`` and ``@dec(...)``)."""
    if fn is None:
        return lambda f: compile_at_first_call(f, **options)
    compiled: Callable | None = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


class _Loader(importlib.abc.Loader):
    """megatron.core.jit's own loader, then ``jit_fuser`` swapped when it is ``torch.compile``."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        import torch

        if getattr(module, "jit_fuser", None) is torch.compile:
            module.jit_fuser = compile_at_first_call


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Hook megatron.core.jit's import (idempotent; a no-op once it is imported)."""
    if TARGET in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
