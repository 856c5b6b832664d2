"""Typed configs: pydantic models, YAML files with dotted CLI overrides, errors that name the field.

Every section is a ``StrictModel`` (unknown keys are errors, not silently ignored). Components add
their own section classes here, each in its own clearly marked block.

    cfg = load_config(TrainConfig, "examples/quickstart.yaml", ["model.num_layers=4", "algo=ppo"])
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator


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
# Model architecture (one of the families in models/arch/)
# ---------------------------------------------------------------------------------------------
class RopeScaling(StrictModel):
    """Llama 3.1 frequency-dependent RoPE scaling (HF rope_type 'llama3')."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)


class ModelConfig(StrictModel):
    """A pre-norm RoPE decoder (RMSNorm, SwiGLU, GQA) of one registered family (models/arch/).

    ``architecture`` names the family (its config.json model_type); the feature fields say what the
    family's layer has beyond Llama's: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), a head_dim
    not equal to hidden_size / heads (``kv_channels``, megatron's name; Qwen3)."""

    architecture: str = Field("llama", description="model family (models/arch/): llama | qwen2 | qwen3 | mistral ...")
    num_layers: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    ffn_hidden_size: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_query_groups: int = Field(gt=0, description="key/value heads (GQA); = heads for MHA")
    kv_channels: int | None = Field(None, gt=0, description="head_dim when not hidden_size / num_attention_heads")
    qkv_bias: bool = Field(False, description="biases on q, k and v (Qwen2)")
    qk_layernorm: bool = Field(False, description="per-head RMSNorm on queries and keys (Qwen3)")
    vocab_size: int = Field(gt=0, description="tokenizer vocabulary; padded for TP at build time")
    max_position_embeddings: int = Field(4096, gt=0)
    rope_theta: float = Field(500000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    norm_epsilon: float = Field(1e-5, gt=0)
    tie_word_embeddings: bool = False
    make_vocab_size_divisible_by: int = Field(128, gt=0)
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    fp8: bool = False

    @model_validator(mode="before")
    @classmethod
    def _family_features(cls, data):
        """Feature fields left out take the family's values (architecture: qwen3 implies qk_layernorm)."""
        if isinstance(data, dict) and isinstance(data.get("architecture"), str):
            from megatron_spo.models.arch import registry

            family = registry().get(data["architecture"])
            if family is not None:
                data = {**family.features, **data}
        return data

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)  # one spelling of the default head_dim, so configs compare
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads} "
                f"(set kv_channels for a head_dim of its own)"
            )
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_query_groups {self.num_query_groups}"
            )
        from megatron_spo.models.arch import architecture  # the registry (imports nothing heavy)

        try:
            problem = architecture(self.architecture).check(self)
        except ValueError as err:  # unknown family: the registry's message lists the known ones
            raise ValueError(f"architecture: {err}") from None
        if problem:
            raise ValueError(f"architecture {self.architecture!r}: {problem}")
        return self

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Vocabulary rounded up to a multiple of make_vocab_size_divisible_by * TP (megatron's rule)."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self) -> int:
        """Parameters of the unpadded model (embeddings + layers + final norm + LM head)."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0) + (2 * d if self.qk_layernorm else 0)
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


# ---------------------------------------------------------------------------------------------
# Quickstart reference model: toy code task + tiny Llama + SFT (megatron_spo/training/reference_model.py)
# ---------------------------------------------------------------------------------------------
class ToyCodeTaskConfig(StrictModel):
    """The generated task (megatron_spo/data/toy_code.py): problems, tests per problem, the split."""

    seed: int = 0
    num_problems: int = Field(240, ge=6)
    heldout_fraction: float = Field(0.5, gt=0, lt=1, description="120 held-out problems by default: enough for a "
                                    "95% interval of about +-0.05 on pass@1")
    num_tests: int = Field(5, gt=0, description="reward tests per problem")
    num_hidden_tests: int = Field(5, gt=0, description="evaluation-only tests per problem")
    max_solutions: int = Field(16, gt=0, description="reference programs kept per problem")
    num_sft_problems: int = Field(900, ge=0, description="extra pipelines seen only in SFT (teach the prompt language)")


class QuickstartModelConfig(StrictModel):
    """A tiny HF model of a registered family (Llama by default; character vocabulary) and its supervised
    fine-tuning on the toy task.

    Half the SFT targets carry their family's input-parsing slip (slip_fraction; toy_code.with_input_slip), so
    the reference fails on about 40% of its samples whatever the problem, for a reason RL can remove on
    problems it never trains on. swap_fraction adds problem-specific noise (a neighbour's solution) instead.
    """

    task: ToyCodeTaskConfig = Field(default_factory=ToyCodeTaskConfig)
    architecture: str = Field("llama", description="model family (models/arch/): llama | qwen2 | qwen3 | mistral")
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(3, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    intermediate_size: int = Field(384, gt=0)
    max_position_embeddings: int = Field(256, gt=0)
    rope_theta: float = Field(10000.0, gt=0)
    norm_epsilon: float = Field(1e-5, gt=0)
    seed: int = 0
    sft_steps: int = Field(600, ge=0)
    batch_size: int = Field(32, gt=0, description="sequences per SFT step")
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay floor, as a fraction of lr")
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    swap_fraction: float = Field(0.0, ge=0, lt=1, description="SFT targets replaced by a neighbour's solution")
    slip_fraction: float = Field(0.5, ge=0, lt=1, description="SFT targets with their family's input-parsing "
                                 "slip (a generic error RL can remove on unseen problems too)")
    num_threads: int = Field(2, gt=0, description="torch CPU threads during SFT (not part of the cache key)")

    @model_validator(mode="after")
    def _check_heads(self) -> QuickstartModelConfig:
        from megatron_spo.models.arch import registry

        if self.architecture not in registry():
            raise ValueError(f"architecture: unknown architecture '{self.architecture}' "
                             f"(supported: {', '.join(registry())})")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        return self


# ---------------------------------------------------------------------------------------------
# Training (megatron_spo/training/trainer.py)
# ---------------------------------------------------------------------------------------------
def _objective(value: str) -> str:
    from megatron_spo.algorithms.spo import OBJECTIVES

    if value not in OBJECTIVES:
        raise ValueError(f"unknown objective '{value}' (choose from {', '.join(OBJECTIVES)})")
    return value


def _loss_name(value: str) -> str:
    """A regression loss of algorithms/spo.py REGRESSION_LOSSES, or a hook 'package.module:function' with
    its signature L(pred_q, target_q, beta, eps) (imported when the trainer starts)."""
    from megatron_spo.algorithms.spo import LOSSES
    from megatron_spo.hooks import is_hook

    if value not in LOSSES and not is_hook(value):
        raise ValueError(f"unknown loss '{value}' (choose from {', '.join(LOSSES)}, or a hook "
                         "'package.module:function')")
    return value


def _algo_name(value: str) -> str:
    """A registered algorithm (training/algos/) or a hook 'package.module:Class'."""
    from megatron_spo.hooks import is_hook

    if not is_hook(value):
        from megatron_spo.training.algos import algorithm_class

        algorithm_class(value, field="algo")
    return value


Objective = Annotated[str, AfterValidator(_objective)]
LossName = Annotated[str, AfterValidator(_loss_name)]
AlgoName = Annotated[str, AfterValidator(_algo_name)]


def _task_kind(value: str) -> str:
    from megatron_spo.data.tasks import TASK_KINDS

    if value not in TASK_KINDS:
        raise ValueError(f"unknown task kind '{value}' (choose from {', '.join(TASK_KINDS)})")
    return value


TaskKindName = Annotated[str, AfterValidator(_task_kind)]


class ProvenanceSelect(StrictModel):
    """Which records of an offline source to train on, by provenance (data/trajectory.py Provenance): each
    given list must contain the record's value (None = any). assume_kind: the kind of records without
    provenance (stores written before it existed)."""

    kinds: list[str] | None = None
    models: list[str] | None = None
    run_ids: list[str] | None = None
    assume_kind: str | None = None


class SourceConfig(StrictModel):
    """One data source of the training batch. The source named 'online' is the rollout buffer; any other
    source reads trajectories from `path` (a JSONL file or an offline-store directory), optionally only those
    of some provenance (`select`)."""

    weight: float = Field(1.0, ge=0, description="share of each batch's trajectories")
    path: str | None = None
    select: ProvenanceSelect | None = None
    objective: Objective = "terminal"
    loss: LossName = "cross_entropy"

    @model_validator(mode="after")
    def _check_pair(self) -> SourceConfig:
        from megatron_spo.algorithms.spo import UNSUPPORTED

        why = UNSUPPORTED.get((self.objective, self.loss))
        if why:
            raise ValueError(f"objective '{self.objective}' with loss '{self.loss}' is not supported ({why})")
        return self


class OptimizerConfig(StrictModel):
    lr: float = Field(6e-8, gt=0, description="paper: 6e-8 for Llama-3.1-8B, constant after warm-up")
    warmup_steps: int = Field(200, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, gt=0)
    value_lr: float | None = Field(None, gt=0, description="PPO value model (default: lr)")


class BatchConfig(StrictModel):
    sequences_per_step: int = Field(128, gt=0, description="global batch: trajectories per optimizer step")
    max_tokens_per_micro_batch: int = Field(16384, gt=0, description="padded tokens per micro-batch")
    max_seq_length: int = Field(4096, gt=1, description="prompt + response tokens; longer ones are refused")


class LogprobsConfig(StrictModel):
    """How the trainer runs the fused LM-head log-prob op (megatron_spo.ops.token_logprobs)."""

    backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="per-block softmax kernels: auto = Triton on a GPU when installed, else torch")
    fp8: bool = Field(False, description="LM-head logits GEMM in FP8 E4M3 (per-tensor scales; softmax statistics "
                      "and gradient GEMMs keep their precision); needs a GPU of compute capability >= 8.9")
    chunk_size: int | None = Field(None, gt=0, description="tokens per block (default min(N, 4096))")
    max_block_bytes: int | None = Field(None, ge=4096, description="bytes of one fp32 logits block "
                                        "(default 64 MiB on CPU, 512 MiB on a GPU)")

    def op_kwargs(self) -> dict:
        """Keyword arguments for token_logprobs (unset sizes left to its defaults)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class PPOConfig(StrictModel):
    clip_eps: float = Field(0.2, gt=0)
    value_clip_eps: float | None = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda. 1 (verl's default): every token's advantage "
                       "carries the terminal reward, G - V_t. At 0.95 a fresh critic's noise dominates the early "
                       "tokens (0.95^60 ~ 0.05 of the reward reaches token 0 of a 60-token answer): quickstart PPO "
                       "pass@1 +0.035 at 0.95, +0.137 at 1 (README)")
    whiten_advantages: bool = True
    critic_warmup_steps: int = Field(0, ge=0, description="first steps train only the value model (verl's "
                                     "critic_warmup): a fresh value head makes GAE advantages noise")


class GRPOConfig(StrictModel):
    """GRPO (training/algos/grpo.py): TRL's GRPOTrainer defaults where it has them."""

    clip_eps: float = Field(0.2, gt=0, description="lower clip of the importance ratio: 1 - clip_eps")
    clip_eps_high: float | None = Field(None, gt=0, description="upper clip 1 + clip_eps_high (DAPO); default clip_eps")
    kl_coef: float = Field(0.0, ge=0, description="k3 KL(pi || pi_0) penalty; TRL's default beta is 0.0")
    scale_rewards: bool = Field(True, description="divide group-centred rewards by the group std")
    aggregation: Literal["sequence_mean", "token_mean"] = Field(
        "token_mean", description="token_mean: over all response tokens of the batch (DAPO / TRL); "
        "sequence_mean: per sequence, then over sequences (the GRPO paper)")


class AGROConfig(StrictModel):
    on_policy: bool = False


class ArchiveConfig(StrictModel):
    """The trainer's experience archive (data/archive.py): every online trajectory it trains on, kept for
    later runs (SPO learns from them offline)."""

    enabled: bool = True
    path: str | None = Field(None, description="an offline store; default RUN_DIR/experience")
    run_id: str | None = Field(None, description="provenance run id of the archived records; default the "
                               "run_dir's name")
    rows_per_shard: int = Field(4096, gt=0, description="records per shard (also flushed at every checkpoint)")


class CheckpointConfig(StrictModel):
    interval: int = Field(100, gt=0, description="save every this many steps (and on SIGTERM / SIGUSR1)")
    keep_last: int = Field(2, gt=0)
    dir: str | None = Field(None, description="default: RUN_DIR/checkpoints")
    export_hf: bool = Field(True, description="write the final policy as an HF directory RUN_DIR/hf")


class LoggingConfig(StrictModel):
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    progress: bool = True
    max_log_ratio: float | None = Field(
        50.0, gt=0, description="stop when the mean sequence log(pi / pi_0) exceeds this (a collapse; FIELD-NOTES)"
    )
    policy_entropy: bool = Field(
        True, description="log the policy's mean per-token entropy (nats) from its log-prob pass: no extra GEMM"
    )


class InitConfig(StrictModel):
    hf: str | None = Field(None, description="HF Llama directory: model config, tokenizer, and weights")
    megatron: str | None = Field(None, description="megatron checkpoint of the same model (converted once)")


class TaskConfig(StrictModel):
    """The prompts of the online source, and their Q0 estimates."""

    kind: TaskKindName = "codecontests"
    reward: str | None = Field(None, description="a custom reward hook 'package.module:function' (problem, "
                               "completion_text) -> float, used for every problem instead of the kind's own")
    paths: list[str] = Field(default_factory=list, description="parquet / jsonl files (not for 'toy')")
    dedup_against: list[str] = Field(default_factory=list, description="TACO test files to remove from training")
    toy: ToyCodeTaskConfig = Field(default_factory=ToyCodeTaskConfig)
    q0_path: str | None = Field(None, description="estimate-q0 output (prompt_id -> Q0); else q0 = 0")
    max_prompt_tokens: int = Field(2048, gt=0)
    limit: int | None = Field(None, gt=0, description="use only the first N training problems")


class FleetEndpoints(StrictModel):
    """Where the rollout engines are. Empty = read SPO_ROUTER_URL / SPO_ENGINE_URLS / ENGINE_TP (set by
    slurm/spo.sbatch)."""

    router_url: str | None = None
    engine_urls: list[str] = Field(default_factory=list)
    engine_tp_size: int | None = Field(None, gt=0, description="TP size every engine was launched with; checked "
                                       "against each engine's /server_info before a weight push (None: trust it)")

    def resolved(self) -> FleetEndpoints:
        import os

        router = self.router_url or os.environ.get("SPO_ROUTER_URL") or None
        engines = self.engine_urls or [u for u in os.environ.get("SPO_ENGINE_URLS", "").replace(",", " ").split() if u]
        tp = self.engine_tp_size
        if tp is None and os.environ.get("ENGINE_TP"):
            try:
                tp = int(os.environ["ENGINE_TP"])
            except ValueError:
                raise ConfigError(f"ENGINE_TP={os.environ['ENGINE_TP']!r} is not an integer") from None
        return FleetEndpoints(router_url=router, engine_urls=engines, engine_tp_size=tp)


class TrainConfig(StrictModel):
    run_dir: str = "runs/spo"
    seed: int = 1234
    steps: int = Field(100_000, gt=0)
    algo: AlgoName = Field("spo", description="spo | agro | ppo | grpo (training/algos/) or 'package.module:Class'")
    beta: float = Field(1.0 / math.log(100000.0), gt=0, description="KL strength; paper 1/log(1e5)")
    model_update_interval: int = Field(10, gt=0, description="steps between weight pushes to the rollout fleet")
    init: InitConfig = Field(default_factory=InitConfig)
    model: ModelConfig | None = Field(None, description="default: read from init.hf/config.json")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    logprobs: LogprobsConfig = Field(default_factory=LogprobsConfig)
    sources: dict[str, SourceConfig] = Field(default_factory=lambda: {"online": SourceConfig()})
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    agro: AGROConfig = Field(default_factory=AGROConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    archive: ArchiveConfig = Field(default_factory=ArchiveConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    fleet: FleetEndpoints = Field(default_factory=FleetEndpoints)
    rollout: RolloutConfig = Field(default_factory=lambda: RolloutConfig())
    sandbox: SandboxConfig = Field(default_factory=lambda: SandboxConfig())
    nproc: int = Field(1, gt=0, description="trainer processes when launched without torchrun/srun")

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if not self.sources:
            raise ValueError("sources: at least one data source is needed")
        if sum(s.weight for s in self.sources.values()) <= 0:
            raise ValueError("sources: the weights must have a positive sum")
        for name, src in self.sources.items():
            if name == "online" and src.path is not None:
                raise ValueError("sources.online.path: the online source reads the rollout buffer, not a path")
            if name != "online" and src.path is None:
                raise ValueError(f"sources.{name}.path: an offline source needs a path")
        from megatron_spo.hooks import is_hook

        if not is_hook(self.algo):  # a hook is loaded (and checked) when the trainer starts
            from megatron_spo.training.algos import algorithm_class

            algorithm_class(self.algo).check_config(self)
        if self.init.hf is None and self.init.megatron is None:
            raise ValueError("init: give init.hf (an HF model directory) or init.megatron (a converted checkpoint)")
        return self


# ---------------------------------------------------------------------------------------------
# Reward sandbox (megatron_spo/rewards/sandbox.py)
# ---------------------------------------------------------------------------------------------
class SandboxConfig(StrictModel):
    """Isolation and limits for running model-written programs against tests.

    isolation "bubblewrap" (the default) unshares every namespace; "rlimits-only" keeps seccomp, rlimits
    and the per-slot uid but no namespaces or filesystem view: chosen explicitly, and warned on every start.
    """

    isolation: Literal["bubblewrap", "rlimits-only"] = "bubblewrap"
    bwrap_path: str = "bwrap"
    python: str = Field("auto", description="interpreter for programs; auto = this one if slot uids can reach it, "
                        "else /usr/bin/python3")
    slots: int = Field(0, ge=0, description="sandboxes running at once; 0 = number of CPUs")
    uid_base: int = Field(1_000_000, ge=1000, description="slot i runs as host uid/gid uid_base + i (when root)")
    time_limit_s: float = Field(2.0, gt=0, description="CPU seconds per test")
    wall_factor: float = Field(2.0, ge=1, description="wall deadline = max(time_limit_s * this, time_limit_s + 1)")
    memory_mb: int = Field(1024, ge=64, description="address-space limit per test (RLIMIT_AS)")
    output_limit_mb: float = Field(16.0, gt=0, description="stdout (and stderr) cap per test")
    tmp_size_mb: int = Field(16, gt=0, description="size of the private /tmp")
    file_size_mb: int = Field(16, gt=0, description="RLIMIT_FSIZE")
    open_files: int = Field(64, ge=16, description="RLIMIT_NOFILE")
    processes: int = Field(64, ge=4, description="RLIMIT_NPROC: threads of the slot uid (fork is denied anyway)")
    startup_timeout_s: float = Field(20.0, gt=0, description="budget for a sandbox to start, on top of its tests")
    prestart: bool = Field(True, description="keep a started sandbox waiting in every idle slot")
    float_tolerance: float | None = Field(None, ge=0, description="token-wise float tolerance when comparing outputs")


# ---------------------------------------------------------------------------------------------
# Rollout fleet (megatron_spo/rollout/: manager, weight sync)
# ---------------------------------------------------------------------------------------------
class RolloutConfig(StrictModel):
    """Asynchronous rollout: sampling, flow control, staleness, retries, weight sync."""

    samples_per_prompt: int = Field(8, gt=0, description="n completions per prompt (one group)")
    temperature_range: tuple[float, float] = Field((0.1, 0.8), description="T ~ U(lo, hi) per request (paper)")
    top_p: float = Field(0.95, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = off")
    max_new_tokens: int = Field(512, gt=0)
    max_inflight_requests: int = Field(8, gt=0, description="concurrent /generate requests")
    buffer_groups: int = Field(64, gt=0, description="bounded buffer of finished groups; full = backpressure")
    max_staleness: int = Field(4, ge=0, description="policy versions a trajectory may lag behind")
    stale_policy: Literal["drop", "tag"] = Field("drop", description="drop stale groups, or keep them (tagged)")
    request_timeout_s: float = Field(300.0, gt=0)
    wait_timeout_s: float = Field(1800.0, gt=0, description="the trainer stops with an error when an online batch "
                                  "does not arrive within this (dead engines, sandbox or rewards), never hangs")
    max_retries: int = Field(5, ge=0, description="retries of one request on engine errors, then it fails")
    retry_backoff_s: float = Field(0.5, gt=0, description="first backoff; doubles per retry up to the max")
    retry_backoff_max_s: float = Field(10.0, gt=0)
    endpoint_max_failures: int = Field(3, gt=0, description="consecutive errors before an endpoint cools down")
    endpoint_cooldown_s: float = Field(5.0, gt=0, description="first cooldown; doubles while it keeps failing")
    seed: int = 0
    weight_sync: Literal["broadcast", "disk"] = "broadcast"
    weight_bucket_mb: float = Field(512.0, gt=0)
    weight_sync_dir: str | None = Field(None, description="shared directory for weight_sync=disk")
    weight_sync_backend: Literal["gloo", "nccl"] = "gloo"
    weight_sync_attempts: int = Field(3, gt=0, description="times a push that reached no engine is sent "
                                      "before the run stops (a push some engines took is not repeated: the "
                                      "others catch up at the next push)")
    weight_sync_pause: Literal["retract", "abort"] = Field(
        "retract", description="how a weight push pauses the engines: retract (requests in flight resume under "
        "the new weights; their samples then span two versions) or abort (they end and are sent again)")
    mixed_version_policy: Literal["tag", "drop"] = Field(
        "tag", description="a sample whose tokens span a weight update: keep it (policy_version = its oldest "
        "token's version, counted) or generate it again")

    @model_validator(mode="after")
    def _check_rollout(self) -> RolloutConfig:
        lo, hi = self.temperature_range
        if not 0 <= lo <= hi:
            raise ValueError(f"temperature_range must satisfy 0 <= lo <= hi, got {list(self.temperature_range)}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.weight_sync == "disk" and not self.weight_sync_dir:
            raise ValueError("weight_sync=disk needs weight_sync_dir")
        return self


# ---------------------------------------------------------------------------------------------
# Capacity plan (megatron_spo/training/capacity.py, `megatron-spo plan`)
# ---------------------------------------------------------------------------------------------
class CapacityConfig(StrictModel):
    """Cluster shape and workload of a plan. Defaults: the 64 + 64 H100 layout of the SPO paper's scale."""

    trainer_gpus: int = Field(64, gt=0)
    worker_gpus: int = Field(64, gt=0)
    gpus_per_node: int = Field(8, gt=0)
    gpu_memory_gb: float = Field(80.0, gt=0)
    micro_batch_size: int = Field(1, gt=0, description="sequences per micro-batch")
    global_batch_size: int = Field(256, gt=0, description="sequences per optimizer step")
    seq_length: int = Field(4096, gt=0, description="prompt + response tokens per (packed) sequence")
    response_tokens: int = Field(2048, gt=0, description="generated tokens per sequence (rollout cost)")
    online_fraction: float = Field(1.0, ge=0, le=1, description="share of each batch generated online")
    recompute: Literal["none", "full"] = Field("none", description="activation recompute used for throughput")
    reference_model: bool = True
    value_model: bool = Field(False, description="PPO critic of the same size (weights, grads, optimizer)")
    logprob_block_mb: float = Field(512.0, gt=0, description="one fp32 logits block of the fused log-prob op, "
                                    "MiB (train.logprobs.max_block_bytes; 512 is its default on a GPU)")
    overhead_gb: float = Field(4.0, ge=0, description="CUDA context, NCCL buffers, fragmentation (assumed)")
    achieved_tflops_per_gpu: float = Field(400.0, gt=0, description="bf16 model TFLOP/s a trainer GPU sustains")
    model_update_interval: int = Field(10, gt=0, description="trainer steps between weight syncs")
    weight_sync_bandwidth_gbps: float = Field(400.0, gt=0, description="network Gb/s into each engine GPU")
    weight_sync_bucket_mb: float = Field(512.0, gt=0)
    weight_sync_bucket_latency_ms: float = Field(
        10.0, ge=0, description="fixed cost per bucket: gather, HTTP update call, NCCL launch (assumed)")
    weight_sync_efficiency: float = Field(0.9, gt=0, le=1, description="achieved share of link bandwidth")


# ---------------------------------------------------------------------------------------------
# Offline tools: estimate-q0, pts, eval (megatron_spo/engine_tools/)
# ---------------------------------------------------------------------------------------------
class ToolSamplingConfig(StrictModel):
    """How an offline tool samples from the engines (one SamplingParams per request)."""

    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, description="-1 = off")
    max_new_tokens: int = Field(512, gt=0)
    seed: int | None = Field(None, description="None: engine randomness, n samples per request. A seed: every "
                             "sample gets its own sampling_seed (one request each), reproducible only on engines "
                             "with deterministic inference (SGLang --enable-deterministic-inference, which shares "
                             "one seed among the n samples of a request and ignores seeds otherwise)")
    samples_per_request: int = Field(64, gt=0, description="n of one /generate call; more samples = more calls")
    concurrency: int = Field(8, gt=0, description="prompts in flight at once")

    @model_validator(mode="after")
    def _check_top_k(self) -> ToolSamplingConfig:
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        return self


class Q0Config(StrictModel):
    """Monte-Carlo S0 / Q0 per prompt from reference samples (SPO paper 3.1.3: 800 samples at T = 1)."""

    samples: int = Field(800, gt=0, description="samples per prompt")
    beta: float = Field(1.0 / math.log(100000.0), gt=0)
    sampling: ToolSamplingConfig = Field(default_factory=ToolSamplingConfig)


class PTSConfig(StrictModel):
    """Pivotal token search (Abdin et al. 2024, as used by the SPO paper for Monte-Carlo targets)."""

    rollouts_per_point: int = Field(10, gt=0, description="K rollouts estimating S_t at one prefix")
    threshold: float = Field(0.2, gt=0, le=1, description="recurse while |S(end) - S(start)| >= threshold")
    max_rollouts: int = Field(200, gt=0, description="rollout budget per trajectory")
    success_reward: float = Field(0.0, description="a trajectory with reward >= this is successful")
    source: str = Field("mc", min_length=1, description="source name of the annotated records")
    sampling: ToolSamplingConfig = Field(default_factory=lambda: ToolSamplingConfig(samples_per_request=16))

    @model_validator(mode="after")
    def _check_budget(self) -> PTSConfig:
        if self.max_rollouts < self.rollouts_per_point:
            raise ValueError(f"max_rollouts ({self.max_rollouts}) < rollouts_per_point ({self.rollouts_per_point}): "
                             "not one estimate fits the budget")
        return self


class EvalConfig(StrictModel):
    """pass@k from n samples per problem (SPO paper: n = 20, T = 0.4, top-p 0.95, k = 1 and 10)."""

    n: int = Field(20, gt=0, description="samples per problem")
    ks: tuple[int, ...] = Field((1, 10), min_length=1)
    hidden_tests: bool = Field(True, description="score with the problems' hidden tests too, when present")
    sampling: ToolSamplingConfig = Field(default_factory=lambda: ToolSamplingConfig(temperature=0.4, top_p=0.95))

    @model_validator(mode="after")
    def _check_ks(self) -> EvalConfig:
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"ks {list(bad)} must lie in [1, n = {self.n}]")
        return self
