"""The model's configs: its architecture (one family of models/arch/), where its weights come from,
and its parallel layout."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from megatron_spo.config import ConfigError, StrictModel


class RopeScaling(StrictModel):
    """Llama 3.1 frequency-dependent RoPE scaling (HF rope_type 'llama3')."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, gt=0)


class MoEConfig(StrictModel):
    """Mixture-of-experts MLP in every decoder layer (megatron-core's MoELayer): a linear router [E, H]
    scores the experts, each token goes to its ``router_topk`` best, whose SwiGLU outputs
    ([H] -> [ffn_hidden_size] -> [H]) are summed with the router's probabilities as weights."""

    num_experts: int = Field(gt=1, description="routed experts per layer (HF num_experts)")
    router_topk: int = Field(gt=0, description="experts per token (HF num_experts_per_tok)")
    ffn_hidden_size: int = Field(gt=0, description="one expert's intermediate size (HF moe_intermediate_size)")
    shared_expert_ffn_hidden_size: int | None = Field(
        None, gt=0, description="a SwiGLU every token goes through beside its routed experts: its intermediate size "
        "(HF shared_expert_intermediate_size, megatron moe_shared_expert_intermediate_size); null = no shared expert")
    shared_expert_gate: bool = Field(
        False, description="the shared expert's output scaled by sigmoid(w . x), w [1, H] (HF shared_expert_gate, "
        "megatron moe_shared_expert_gate)")
    norm_topk_prob: bool = Field(
        True, description="true: softmax over the top-k logits (the k weights sum to 1); false: softmax over all "
        "experts, then top-k (HF norm_topk_prob; megatron moe_router_pre_softmax = not this)")
    aux_loss_coeff: float = Field(
        0.0, ge=0, description="load-balancing loss coefficient added to the training loss's gradient (megatron "
        "moe_aux_loss_coeff, HF router_aux_loss_coef); 0 = no load-balancing loss")
    token_dispatcher: Literal["auto", "allgather", "alltoall"] = Field(
        "auto", description="megatron moe_token_dispatcher_type: how tokens reach experts on other EP ranks. "
        "allgather gathers equal token counts over TP x EP; alltoall exchanges what the routing sends (unequal counts "
        "per rank: packed micro-batches at EP > 1); auto: alltoall at EP > 1, else allgather")

    @model_validator(mode="after")
    def _check_topk(self) -> MoEConfig:
        if self.router_topk > self.num_experts:
            raise ValueError(f"moe.router_topk {self.router_topk} is larger than moe.num_experts {self.num_experts}")
        if self.shared_expert_gate and self.shared_expert_ffn_hidden_size is None:
            raise ValueError("moe.shared_expert_gate needs moe.shared_expert_ffn_hidden_size (a shared expert)")
        return self

    def shared_expert_parameters(self, hidden_size: int) -> int:
        """The shared expert's gate / up [Fs, H], down [H, Fs] and its gate [1, H] (0 without one)."""
        fs = self.shared_expert_ffn_hidden_size or 0
        return 3 * hidden_size * fs + (hidden_size if self.shared_expert_gate else 0)


class ModelConfig(StrictModel):
    """A pre-norm RoPE decoder (RMSNorm, SwiGLU, GQA) of one registered family (models/arch/).

    ``architecture`` names the family (its config.json model_type); the feature fields say what the
    family's layer has beyond Llama's: q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3), a head_dim
    not equal to hidden_size / heads (``kv_channels``, megatron's name; Qwen3)."""

    architecture: str = Field("llama", description="model family: a module of models/arch/ (its model_type)")
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
    moe: MoEConfig | None = Field(None, description="mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE); null = dense "
                                  "SwiGLU")

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
        from megatron_spo.models.arch import architecture, registry  # (imports nothing heavy)

        try:
            family = architecture(self.architecture)
        except ValueError as err:  # unknown family: the registry's message lists the known ones
            raise ValueError(f"architecture: {err}") from None
        if self.moe is not None and not family.experts:
            raise ValueError(f"moe: architecture {self.architecture!r} has no experts (a mixture-of-experts family: "
                             f"{', '.join(n for n, a in registry().items() if a.experts)})")
        problem = family.check(self)
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
        mlp = 3 * h * f if self.moe is None else (self.moe.num_experts * (3 * h * self.moe.ffn_hidden_size + h)
                                                  + self.moe.shared_expert_parameters(h))
        layer = attn + mlp + 2 * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + h + head

    def stage_parameters(self, tp: int = 1, pp: int = 1) -> int:
        """Parameters held by one GPU of the largest pipeline stage under TP x PP, the vocabulary padded as
        megatron pads it (embedding on the first stage, LM head on the last); tp = pp = 1: the whole model."""
        h, f, d = self.hidden_size, self.ffn_hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_query_groups * d  # q != h where head_dim is its own (Qwen3)
        vocab = self.padded_vocab_size(tp)
        bias = q + 2 * kv if self.qkv_bias else 0
        qk_norms = 2 * d if self.qk_layernorm else 0
        if self.moe is None:
            layer = (2 * h * q + 2 * h * kv + 3 * h * f + bias) // tp + 2 * h + qk_norms  # norms are replicated over TP
        else:  # experts split over EP (here 1) and expert-TP (= tp), a shared expert over TP; routers replicated
            experts = self.moe.num_experts * 3 * h * self.moe.ffn_hidden_size
            shared = 3 * h * (self.moe.shared_expert_ffn_hidden_size or 0)
            gates = self.moe.num_experts * h + (h if self.moe.shared_expert_gate else 0)
            layer = (2 * h * q + 2 * h * kv + bias + experts + shared) // tp + gates + 2 * h + qk_norms
        layers = math.ceil(self.num_layers / pp) * layer
        embedding = vocab * h // tp
        head = 0 if self.tie_word_embeddings else vocab * h // tp
        if pp == 1:
            return layers + embedding + head + h
        return layers + max(embedding, head + h)


class InitConfig(StrictModel):
    hf: str | None = Field(None, description="HF Llama directory: model config, tokenizer, and weights")
    megatron: str | None = Field(None, description="megatron checkpoint of the same model (converted once)")


class ParallelConfig(StrictModel):
    """How the model runs: its TP / PP / DP layout, the local spec's attention kernel, activation recompute."""

    tensor_model_parallel_size: int = Field(1, gt=0)
    pipeline_model_parallel_size: int = Field(1, gt=0)
    virtual_pipeline_model_parallel_size: int | None = Field(None, gt=0)
    expert_model_parallel_size: int = Field(
        1, gt=0, description="EP: a mixture-of-experts layer's experts split over this many ranks (each expert "
        "further split over TP, megatron's expert-tensor-parallel default)")
    context_parallel_size: int = Field(
        1, gt=0, description="CP: each sequence split into 2 x CP chunks over this many ranks (rank r holds chunks r "
        "and 2 CP - 1 - r, so causal work is balanced); keys / values all-gathered over the CP group in every layer "
        "(docs/long-sequences.md)")
    sequence_parallel: bool = Field(
        False, description="SP: under TP > 1 the norms, residuals and dropout run on 1 / TP of the sequence each "
        "(megatron-core's sequence parallelism; the local spec's norms too)")
    use_distributed_optimizer: bool = False
    attention_kernel: Literal["sdpa", "dot_product"] = Field(
        "sdpa", description="core attention of the local (no Transformer Engine) layer spec: sdpa = torch's "
        "scaled_dot_product_attention (memory linear in tokens; packed sequences); dot_product = megatron-core's "
        "DotProductAttention ([s, s] scores; padded batches only). The TE spec keeps TE's attention")
    recompute_granularity: Literal["selective", "full"] | None = Field(
        None, description="megatron-core activation recompute: selective = the recompute_modules of every layer; "
        "full = whole layers (recompute_method, recompute_num_layers); unset = every activation kept")
    recompute_method: Literal["uniform", "block"] | None = Field(
        None, description="full recompute: uniform = every layer in units of recompute_num_layers; block = the "
        "first recompute_num_layers layers of each pipeline stage")
    recompute_num_layers: int | None = Field(None, gt=0, description="full recompute: layers per unit (uniform) "
                                             "or per stage (block)")
    recompute_modules: list[Literal["core_attn", "mlp", "layernorm"]] | None = Field(
        None, description="selective recompute: the submodules recomputed (megatron's default: core_attn)")

    @model_validator(mode="after")
    def _check_recompute(self) -> ParallelConfig:
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ValueError("recompute_granularity 'full' needs recompute_method (uniform | block) and "
                             "recompute_num_layers")
        if not full and (self.recompute_method is not None or self.recompute_num_layers is not None):
            raise ValueError("recompute_method / recompute_num_layers act only with recompute_granularity 'full'")
        if self.recompute_modules is not None and self.recompute_granularity != "selective":
            raise ValueError("recompute_modules acts only with recompute_granularity 'selective'")
        return self

    def data_parallel_size(self, world_size: int) -> int:
        """Data-parallel replicas: world size / (TP x PP x CP); the CP ranks of a replica share its micro-batches."""
        cp = self.context_parallel_size
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size * cp
        if world_size % mp:
            raise ConfigError(
                f"parallel: world size {world_size} is not divisible by tensor_model_parallel_size "
                f"{self.tensor_model_parallel_size} x pipeline_model_parallel_size "
                f"{self.pipeline_model_parallel_size}" + (f" x context_parallel_size {cp}" if cp > 1 else "")
                + f" = {mp}"
            )
        return world_size // mp

    def sequence_multiple(self) -> int:
        """What a micro-batch's token count (a padded row, a packed stream) is padded to: 2 x CP (each sequence is cut
        into 2 x CP chunks) and CP x TP under sequence parallelism (each CP rank's share is cut over the TP ranks)."""
        cp = self.context_parallel_size
        return math.lcm(2 * cp if cp > 1 else 1, cp * (self.tensor_model_parallel_size if self.sequence_parallel else 1))

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
        if model.moe is None and model.ffn_hidden_size % tp:  # a MoE model's layers have experts, no dense MLP
            raise ConfigError(
                f"parallel.tensor_model_parallel_size {tp} does not divide model.ffn_hidden_size "
                f"{model.ffn_hidden_size}"
            )
        self._check_experts(model, world_size)
        stages = pp * (self.virtual_pipeline_model_parallel_size or 1)
        if model.num_layers % stages:
            raise ConfigError(
                f"parallel: pipeline_model_parallel_size {pp} x virtual_pipeline_model_parallel_size "
                f"{self.virtual_pipeline_model_parallel_size or 1} = {stages} does not divide model.num_layers "
                f"{model.num_layers}"
            )
        if self.virtual_pipeline_model_parallel_size and pp == 1:
            raise ConfigError("parallel.virtual_pipeline_model_parallel_size needs pipeline_model_parallel_size > 1")
        if self.sequence_parallel and tp == 1:
            raise ConfigError("parallel.sequence_parallel needs tensor_model_parallel_size > 1 (it splits the "
                              "sequence over the TP ranks)")
        if self.context_parallel_size > 1 and self.attention_kernel == "dot_product":
            raise ConfigError(f"parallel.context_parallel_size {self.context_parallel_size}: megatron-core's "
                              "DotProductAttention (parallel.attention_kernel dot_product) refuses context "
                              "parallelism; use attention_kernel sdpa")
        if world_size is not None:
            self.data_parallel_size(world_size)

    def check_training(self, model: ModelConfig) -> None:
        """What training adds to ``check``: megatron-core's MoE layer refuses to train at TP > 1 without sequence
        parallelism (at its first forward), and expert parallelism needs a dispatcher that takes each rank's own
        token count; refused here first, in one line."""
        if model.moe is not None and self.tensor_model_parallel_size > 1 and not self.sequence_parallel:
            raise ConfigError(f"parallel: a mixture-of-experts model trains at tensor_model_parallel_size "
                              f"{self.tensor_model_parallel_size} only with parallel.sequence_parallel (megatron-core "
                              f"refuses MoE + TP without it)")
        if model.moe is not None and self.expert_model_parallel_size > 1 and model.moe.token_dispatcher == "allgather":
            # the ranks of an expert group train their own micro-batches (their own token counts): measured, gloo's
            # all-gather of unequal token counts aborts
            raise ConfigError(f"model.moe.token_dispatcher: allgather needs equal token counts on every rank of an "
                              f"expert group, which the data-parallel ranks' micro-batches do not have at "
                              f"parallel.expert_model_parallel_size {self.expert_model_parallel_size}; use alltoall "
                              f"(or auto)")

    def _check_experts(self, model: ModelConfig, world_size: int | None) -> None:
        tp, ep = self.tensor_model_parallel_size, self.expert_model_parallel_size
        if model.moe is None:
            if ep > 1:
                raise ConfigError(f"parallel.expert_model_parallel_size {ep} needs a mixture-of-experts model "
                                  f"(model.moe is null)")
            return
        if model.moe.num_experts % ep:
            raise ConfigError(f"parallel.expert_model_parallel_size {ep} does not divide model.moe.num_experts "
                              f"{model.moe.num_experts}")
        if model.moe.ffn_hidden_size % tp:
            raise ConfigError(f"parallel.tensor_model_parallel_size {tp} does not divide model.moe.ffn_hidden_size "
                              f"{model.moe.ffn_hidden_size}")
        if (model.moe.shared_expert_ffn_hidden_size or 0) % tp:
            raise ConfigError(f"parallel.tensor_model_parallel_size {tp} does not divide "
                              f"model.moe.shared_expert_ffn_hidden_size {model.moe.shared_expert_ffn_hidden_size}")
        expert_ranks = tp * ep * self.pipeline_model_parallel_size
        if world_size is not None and world_size % expert_ranks:
            raise ConfigError(
                f"parallel: world size {world_size} is not divisible by tensor_model_parallel_size {tp} x "
                f"expert_model_parallel_size {ep} x pipeline_model_parallel_size "
                f"{self.pipeline_model_parallel_size} = {expert_ranks}")
