"""The architecture registry: one module per Hugging Face decoder family, found by listing this package.

    arch = architecture("qwen3")                 # by ModelConfig.architecture (config.json model_type)
    arch = architecture_of_hf(raw, "x/config.json")   # by config.json 'architectures'
    names()                                      # every registered family

Adding a family = one new module here defining ``ARCHITECTURE`` (see base.py) + its tests. Nothing in
this package imports megatron or transformers.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from megatron_spo.models.arch.base import Architecture, UnsupportedHFConfig

_NOT_FAMILIES = {"base"}


@functools.cache
def registry() -> dict[str, Architecture]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name in _NOT_FAMILIES:
            continue
        arch = importlib.import_module(f"{__name__}.{info.name}").ARCHITECTURE
        found[arch.name] = arch
    return found


def names() -> list[str]:
    return list(registry())


def architecture(name: str) -> Architecture:
    try:
        return registry()[name]
    except KeyError:
        raise UnsupportedHFConfig(f"unknown architecture '{name}' (supported: {', '.join(names())})") from None


def supported_hf_classes() -> list[str]:
    return [a.hf_class for a in registry().values()]


def architecture_of_hf(raw: dict, source: str = "config.json") -> Architecture:
    """The family of a config.json, by its 'architectures' entry (or 'model_type' when that is absent)."""
    archs = raw.get("architectures") or []
    by_class = {a.hf_class: a for a in registry().values()}
    if len(archs) == 1 and archs[0] in by_class:
        return by_class[archs[0]]
    if not archs and raw.get("model_type") in registry():
        return registry()[raw["model_type"]]
    raise UnsupportedHFConfig(
        f"{source}: unsupported architecture {archs or raw.get('model_type')!r} "
        f"(field 'architectures'; supported: {', '.join(supported_hf_classes())})"
    )
