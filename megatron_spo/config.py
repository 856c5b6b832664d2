"""The config loader: strict pydantic models, YAML files with dotted CLI overrides, errors that name the field.

Every section is a ``StrictModel`` (unknown keys are errors, not silently ignored). The sections live with
what they configure (models/config.py, rollout/config.py, rewards/config.py, data/config.py,
engine_tools/config.py, training/config.py, experiments/config.py, planning/config.py); this module imports
nothing of the project, so any floor can build its config on it.

    cfg = load_config(TrainConfig, "examples/quickstart.yaml", ["model.num_layers=4", "algo=ppo"])
"""

from __future__ import annotations

import json
import re
import reprlib
import types
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
)


class ConfigError(ValueError):
    """A config that cannot work. The message is one line and names the field (and the file)."""


class StrictModel(BaseModel):
    """Unknown keys are errors; floats must be finite (no .inf / .nan); a bool is no number (``steps: true``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _number_only(field.annotation):
                raise ValueError(f"expected a number, got the boolean {str(value).lower()}")
        return value


def _number_only(annotation: Any) -> bool:
    """Whether a field's type is a number (int / float, optional or constrained) that pydantic would let
    True / False into as 1 / 0."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _number_only(get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return bool(args) and all(_number_only(a) for a in args)
    return isinstance(annotation, type) and issubclass(annotation, (int, float)) and annotation is not bool


class ConfigView(StrictModel):
    """Some sections of a larger config file, read by a tool that needs only those: the other keys are left to
    the config that owns them (a training config read by an offline tool, say)."""

    model_config = ConfigDict(**{**StrictModel.model_config, "extra": "ignore"})


M = TypeVar("M", bound=BaseModel)
QUOTE_CHARS = 80  # longest value an error line quotes
MAX_CONFIG_BYTES = 4 << 20  # a config file is text a person wrote: 4 MiB is far beyond any
MAX_CONFIG_NODES = 100_000  # values after alias expansion (a 558-byte alias bomb expands to ~10^9)
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")  # the floats YAML 1.2 reads and 1.1 does not


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
        value = parse_yaml(raw) if raw.strip() else ""
    except _Refused as err:
        raise ConfigError(f"override {quote(item)}: {err.problem}") from None
    except (yaml.YAMLError, RecursionError):
        value = raw
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
        loc = ".".join(str(p) for p in e["loc"])  # empty: a model-wide rule, whose message names its fields
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        got = e.get("input")
        tail = "" if e["type"] in ("missing", "extra_forbidden") or isinstance(got, dict) else f" (got {quote(got)})"
        lines.append(": ".join(part for part in (source, loc, f"{msg}{tail}") if part))
    return "; ".join(lines)


def quote(value: Any, limit: int = QUOTE_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error line never carries a whole hostile value.
    Containers are cut while they are written, so a huge (or alias-shared) value costs no memory."""
    cut = reprlib.Repr()
    cut.maxstring = cut.maxother = limit
    cut.maxlist = cut.maxdict = cut.maxtuple = cut.maxset = 8
    cut.maxlevel = 3
    text = cut.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
        loaded = read_yaml(path)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
        data = loaded
    apply_overrides(data, overrides or [])
    return build_config(cls, data, source)


def read_yaml(path: str | Path, max_bytes: int = MAX_CONFIG_BYTES, max_nodes: int = MAX_CONFIG_NODES) -> Any:
    """A YAML (or JSON) file we did not write, parsed safely: at most ``max_bytes``, no duplicate keys,
    and at most ``max_nodes`` values once aliases are expanded (an alias bomb is refused before it is built).
    Raises ConfigError naming the file (and line)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist" if not p.is_dir() else f"config '{path}' is a folder")
    size = p.stat().st_size
    if size > max_bytes:
        raise ConfigError(f"{path}: {size} bytes, more than a config may hold ({max_bytes})")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start})") from None
    try:
        return parse_yaml(text, max_nodes)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        what = problem if isinstance(err, _Refused) else f"invalid YAML ({problem})"
        raise ConfigError(f"{path}{where}: {what}") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply") from None


def parse_yaml(text: str, max_nodes: int = MAX_CONFIG_NODES) -> Any:
    """``yaml.safe_load`` without duplicate keys or alias bombs (yaml.YAMLError otherwise)."""
    loader = _StrictYamlLoader(text, max_nodes)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


class _Refused(yaml.MarkedYAMLError):
    """Valid YAML that a config may not be (duplicate keys, an alias bomb)."""


class _StrictYamlLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and caps the size of the value aliases would expand to."""

    def __init__(self, text: str, max_nodes: int):
        super().__init__(text)
        self.max_nodes = max_nodes
        self._sizes: dict[int, int] = {}

    def compose_document(self):
        node = super().compose_document()
        if self._expanded_size(node) > self.max_nodes:
            raise _Refused(problem=f"more than {self.max_nodes} values once its aliases (*name) are expanded")
        return node

    def _expanded_size(self, node) -> int:
        """Values the node stands for with aliases copied out (memoised per node, so shared nodes are counted
        without being walked again: linear in the document, not in the expansion)."""
        key = id(node)
        if key not in self._sizes:
            self._sizes[key] = 0  # a self-referencing anchor counts once
            if isinstance(node, yaml.SequenceNode):
                total = 1 + sum(self._expanded_size(child) for child in node.value)
            elif isinstance(node, yaml.MappingNode):
                total = 1 + sum(self._expanded_size(k) + self._expanded_size(v) for k, v in node.value)
            else:
                total = 1
            self._sizes[key] = min(total, self.max_nodes + 1)
        return self._sizes[key]

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}  # key -> line it first appears on
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base': its keys may be overridden here
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.get(key)
                    seen[key] = first or key_node.start_mark.line + 1
                except TypeError:
                    continue  # an unhashable key: the base class reports it
                if first is not None:
                    raise _Refused(problem=f"duplicate key {quote(key)} (first on line {first})",
                                   problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


class DuplicateKeyError(ValueError):
    """A JSON object holding a key twice (``json.loads`` would keep the last value silently); ``key`` names it."""

    def __init__(self, key: str):
        self.key = key
        super().__init__(f"duplicate key {quote(key)}")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):  # the rare case: find the key (the common one costs one length compare)
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return obj


def loads_json(text: str | bytes) -> Any:
    """``json.loads`` that refuses a key given twice in any object, at any depth (DuplicateKeyError, a ValueError
    whose ``key`` the caller names with the file and line): the JSON counterpart of the configs' strict YAML
    loader, for the JSONL a user hands in (trajectories, problems, Q0 files)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)


# YAML 1.1 reads 2e-5 (no dot) as a string, anywhere: a file's `lr: 2e-5`, an override's `{"lr": 2e-5}`; YAML 1.2
# and JSON read a number, and so does a config here (a string lr crashed `compare` with "Unknown format code 'g'")
_StrictYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+.0123456789"))


def dump_config(cfg: BaseModel) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
