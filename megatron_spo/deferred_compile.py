"""megatron-core's compiled functions compiled at their first call, not when megatron-core is imported.

megatron-core applies ``torch.compile`` at import time: its fused functions through ``megatron.core.jit.jit_fuser``
(which is ``torch.compile``) and, from 0.19, a ``@torch.compile`` method of the MoE inference router. Compilation
is lazy in torch (at the first call), but the decorator alone imports torch._dynamo and torch._inductor: ~4 of the
~10 CPU seconds that importing megatron-core costs a process on this project's 2-core CPU machine, paid by every
trainer rank, converter and test process, most of which never call a compiled function (the CPU configs turn the
fusions off). ``install()`` (run by ``megatron_spo/__init__``) hooks the import of megatron-core's modules: while
one executes, ``torch.compile`` is ``compile_at_first_call``, which hands the function and the decorator's
arguments to the real ``torch.compile`` on the first call and runs the compiled function from then on, as before.
It does nothing when megatron-core is imported before megatron_spo.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

PACKAGE = "megatron.core"
_real_compile: Callable | None = None  # torch.compile, kept while a megatron-core module executes
_depth = 0  # megatron-core modules executing (their imports nest)


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

            compiled = (_real_compile or torch.compile)(fn, **options)
        return compiled(*args, **kwargs)

    return call


class _Loader(importlib.abc.Loader):
    """A megatron-core module's own loader, run with ``torch.compile`` swapped for ``compile_at_first_call``."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the inner loader's
        return getattr(self.inner, name)

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        global _depth, _real_compile
        import torch

        if _depth == 0 and torch.compile is not compile_at_first_call:
            _real_compile, torch.compile = torch.compile, compile_at_first_call
        _depth += 1
        try:
            self.inner.exec_module(module)
        finally:
            _depth -= 1
            if _depth == 0 and _real_compile is not None:
                torch.compile = _real_compile


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != PACKAGE and not fullname.startswith(PACKAGE + "."):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


def install() -> None:
    """Hook megatron-core's imports (idempotent; a no-op once megatron-core is imported)."""
    if PACKAGE in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
