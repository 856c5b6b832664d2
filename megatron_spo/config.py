"""The config loader: strict pydantic models, YAML files with dotted CLI overrides, errors that name the field.

Every section is a ``StrictModel`` (unknown keys are errors, not silently ignored). The sections live with
what they configure (models/config.py, rollout/config.py, rewards/config.py, data/config.py,
engine_tools/config.py, training/config.py, experiments/config.py, planning/config.py); this module imports
nothing of the project, so any floor can build its config on it.

    cfg = load_config(TrainConfig, "examples/quickstart.yaml", ["model.num_layers=4", "algo=ppo"])
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class ConfigError(ValueError):
    """A config that cannot work. The message is one line and names the field (and the file)."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


class ConfigView(StrictModel):
    """Some sections of a larger config file, read by a tool that needs only those: the other keys are left to
    the config that owns them (a training config read by an offline tool, say)."""

    model_config = ConfigDict(**{**StrictModel.model_config, "extra": "ignore"})


M = TypeVar("M", bound=BaseModel)
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


# ---------------------------------------------------------------------------------------------
# Loading: YAML + dotted overrides
# ---------------------------------------------------------------------------------------------
def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], yaml-parsed value)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key.path=value")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads '2e-5' (no dot) as a string
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each dotted key in a nested dict (creating sub-dicts), returning the same dict."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"override '{item}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def format_validation_error(err: ValidationError, source: str | None = None) -> str:
    """One line per problem: 'file: field.path: message (got value)'."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        got = e.get("input")
        tail = "" if e["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{source + ': ' if source else ''}{loc}: {msg}{tail}")
    return "; ".join(lines)


def build_config(cls: type[M], data: dict, source: str | None = None) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_config(cls: type[M], path: str | Path | None = None, overrides: list[str] | None = None) -> M:
    """Read YAML (optional), apply dotted overrides, validate into ``cls``."""
    data: dict = {}
    source = None
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: invalid YAML ({getattr(err, 'problem', err)})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    apply_overrides(data, overrides or [])
    return build_config(cls, data, source)


def dump_config(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
