"""The algorithm registry: one module per algorithm, each an ``Algorithm`` subclass (base.py).

    cls = algorithm_class("spo")                   # or a hook "my_package.module:MyAlgorithm"
    names()                                        # every registered name, sorted: the config's choices and
                                                   # its error messages derive from this, never a list by hand

Adding an algorithm = one new module here defining a subclass with a ``name`` (+ its tests); a user's own is
named in the config as ``algo: package.module:Class`` and loaded at start-up.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from megatron_spo.training.algos.base import Algorithm, StepInputs, Update

__all__ = ["Algorithm", "StepInputs", "Update", "algorithm_class", "algorithm_needs_q0", "names", "registry"]


@functools.cache
def registry() -> dict[str, type[Algorithm]]:
    found: dict[str, type[Algorithm]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, Algorithm) and obj.__module__ == module.__name__:
                found[obj.name] = obj
    return dict(sorted(found.items()))


def names() -> list[str]:
    return list(registry())


def algorithm_class(name: str, field: str = "algo", *, load_hooks: bool = True) -> type[Algorithm] | None:
    """The one lookup of an algorithm name: a registered algorithm, or a hook 'package.module:Class' (a
    subclass of Algorithm) imported now; for a hook with load_hooks=False, None (building a config does not
    import user code: the trainer does when it starts). ValueError naming the field otherwise."""
    from megatron_spo.hooks import is_hook, load_hook

    if is_hook(name):
        if not load_hooks:
            return None
        cls = load_hook(name, field=field, want="class")
        if not issubclass(cls, Algorithm):
            raise ValueError(f"{field}: '{name}' is not a subclass of megatron_spo.training.algos.Algorithm")
        return cls
    if name not in registry():
        raise ValueError(f"{field}: unknown algorithm '{name}' (choose from {', '.join(names())}, or a hook "
                         "'package.module:Class')")
    return registry()[name]


def algorithm_needs_q0(cfg) -> bool:
    """Whether the algorithm of cfg (a TrainConfig: cfg.algo) reads each trajectory's Q0 (SPO; a hooked class by
    its ``uses_q0`` flag)."""
    return algorithm_class(cfg.algo).uses_q0
