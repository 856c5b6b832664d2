"""Typed configs: pydantic models, YAML files with dotted CLI overrides, errors that name the field.

Every section is a ``StrictModel`` (unknown keys are errors, not silently ignored). Components add
their own section classes here, each in its own clearly marked block.

    cfg = load_config(TrainConfig, "examples/quickstart.yaml", ["model.num_layers=4", "algo=ppo"])
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator


class ConfigError(ValueError):
    """A config that cannot work. The message is one line and names the field (and the file)."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


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


# ---------------------------------------------------------------------------------------------
# Model architecture (Llama family)
# ---------------------------------------------------------------------------------------------
class RopeScaling(StrictModel):
    """Llama 3.1 frequency-dependent RoPE scaling (HF rope_type 'llama3')."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)


class ModelConfig(StrictModel):
    """A Llama-architecture decoder (RMSNorm, SwiGLU, RoPE, GQA, untied embeddings by default)."""

    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0, description="key/value heads (GQA); = heads for MHA")
    vocab_size: int = Field(gt=0, description="tokenizer vocabulary; padded for TP at build time")
    max_position_embeddings: int = Field(4096, gt=0)
    rope_theta: float = Field(500000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    norm_epsilon: float = Field(1e-5, gt=0)
    tie_word_embeddings: bool = False
    make_vocab_size_divisible_by: int = Field(128, gt=0)
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    fp8: bool = False

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {self.num_query_groups}"
            )
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * TP (megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameters of the unpadded model (embeddings + layers + final norm + LM head)."""
        h, f, kv = self.hidden_size, self.ffn_hidden_size, self.num_query_groups * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        mlp = 3 * h * f
        layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head


# ---------------------------------------------------------------------------------------------
# Parallel layout
# ---------------------------------------------------------------------------------------------
class ParallelConfig(StrictModel):
    tensor_model_parallel_size: int = Field(1, gt=0)
    pipeline_model_parallel_size: int = Field(1, gt=0)
    virtual_pipeline_model_parallel_size: int | None = Field(None, gt=0)
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % mp:
            raise ConfigError(
                f"parallel: world size {world_size} is not divisible by tensor_model_parallel_size "
                f"{self.tensor_model_parallel_size} x pipeline_model_parallel_size "
                f"{self.pipeline_model_parallel_size} = {mp}"
            )
        return world_size // mp

    def check(self, model: ModelConfig, world_size: int | None = None) -> None:
        """Refuse a layout that cannot work, before any process group is built."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        if model.num_attention_heads % tp:
            raise ConfigError(
                f"parallel.tensor_model_parallel_size {tp} does not divide model.num_attention_heads "
                f"{model.num_attention_heads}"
            )
        if model.num_query_groups % tp:
            raise ConfigError(
                f"parallel.tensor_model_parallel_size {tp} does not divide model.num_query_groups "
                f"{model.num_query_groups}"
            )
        if model.ffn_hidden_size % tp:
            raise ConfigError(
                f"parallel.tensor_model_parallel_size {tp} does not divide model.ffn_hidden_size "
                f"{model.ffn_hidden_size}"
            )
        stages = pp * (self.virtual_pipeline_model_parallel_size or 1)
        if model.num_layers % stages:
            raise ConfigError(
                f"parallel: pipeline_model_parallel_size {pp} x virtual_pipeline_model_parallel_size "
                f"{self.virtual_pipeline_model_parallel_size or 1} = {stages} does not divide model.num_layers "
                f"{model.num_layers}"
            )
        if self.virtual_pipeline_model_parallel_size and pp == 1:
            raise ConfigError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1")
        if world_size is not None:
            self.data_parallel_size(world_size)
