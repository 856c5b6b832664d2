"""What a model family declares: its HF config reading/writing, its megatron knobs and its rule table.

An ``Architecture`` is one Hugging Face decoder family (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...).
The project's own ``ModelConfig`` describes every family with a few feature fields (``kv_channels``,
``qkv_bias``, ``qk_layernorm``, ``rope_scaling``, ``tie_word_embeddings``); the family says which HF
config.json fields map onto them, which HF fields it refuses by name (sliding windows, MoE, rope types
it cannot honour), and the HF <-> Megatron name rules of one decoder layer.

Mixture-of-experts families add the router (replicated) and one fc1 + row rule per expert (``Rule.expert``).

Rule kinds (TP split rules live in ``hf_map``):
  replicated  norms, the same tensor on every TP rank
  qkv         q/k/v (weights [rows, H] or biases [rows]) interleaved per KV group, TP dim 0
  fc1         cat[gate, up], gate and up split separately over TP
  row         TP dim 1 (attention output and fc2)
  vocab       embeddings / LM head: TP dim 0 over the padded vocabulary
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_spo.models.config import ModelConfig, RopeScaling

Shape = tuple[int, ...]

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

# Token ids and similar fields of a source config.json that ride along through a conversion.
CARRIED_HF_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache")
_DTYPE_NAMES = {
    "float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
    "fp32": "float32", "bf16": "bfloat16", "fp16": "float16",
}


class UnsupportedHFConfig(ValueError):
    """config.json asks for something the family (or this project) cannot honour; names the field."""


@dataclass(frozen=True)
class Rule:
    """One Megatron parameter and the HF tensors it is made of."""

    megatron: str  # name inside a layer (layer rules) or inside the GPTModel (model rules)
    hf: tuple[str, ...]  # HF names; '{i}' is the global layer index
    kind: str  # "replicated" | "qkv" | "fc1" | "row" | "vocab"
    shapes: Callable[[ModelConfig], tuple[Shape, ...]]  # the HF tensors' shapes, one per name in ``hf``
    te_alias: str | None = None  # name in the Transformer Engine spec (norms fused into linears)
    expert: int | None = None  # an expert's rule: its global index; megatron holds '{j}', the expert's index
    #                            among the experts of the EP rank holding it (= expert at EP 1)

    def megatron_name(self, local: int | None = None) -> str:
        """The parameter's name inside its module (an expert's: as local expert ``local``, default its own index)."""
        return self.megatron if self.expert is None else self.megatron.format(j=self.expert if local is None else local)

    def key(self) -> str:
        """A unique name of the rule within a layer (an expert's carries its global index)."""
        return self.megatron_name()


# --- shapes -----------------------------------------------------------------------------------
def _hidden(c: ModelConfig) -> tuple[Shape, ...]:
    return ((c.hidden_size,),)


def _qkv_weight(c: ModelConfig) -> tuple[Shape, ...]:
    q, kv = c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim
    return ((q, c.hidden_size), (kv, c.hidden_size), (kv, c.hidden_size))


def _qkv_bias(c: ModelConfig) -> tuple[Shape, ...]:
    q, kv = c.num_attention_heads * c.head_dim, c.num_query_groups * c.head_dim
    return ((q,), (kv,), (kv,))


def _head_dim(c: ModelConfig) -> tuple[Shape, ...]:
    return ((c.head_dim,),)


def _vocab(c: ModelConfig) -> tuple[Shape, ...]:
    return ((c.vocab_size, c.hidden_size),)


# --- the rules every family here shares -------------------------------------------------------
_L = "model.layers.{i}."
INPUT_NORM = Rule("input_layernorm.weight", (_L + "input_layernorm.weight",), "replicated", _hidden,
                  te_alias="self_attention.linear_qkv.layer_norm_weight")
QKV = Rule("self_attention.linear_qkv.weight",
           (_L + "self_attn.q_proj.weight", _L + "self_attn.k_proj.weight", _L + "self_attn.v_proj.weight"),
           "qkv", _qkv_weight)
QKV_BIAS = Rule("self_attention.linear_qkv.bias",
                (_L + "self_attn.q_proj.bias", _L + "self_attn.k_proj.bias", _L + "self_attn.v_proj.bias"),
                "qkv", _qkv_bias)
Q_NORM = Rule("self_attention.q_layernorm.weight", (_L + "self_attn.q_norm.weight",), "replicated", _head_dim)
K_NORM = Rule("self_attention.k_layernorm.weight", (_L + "self_attn.k_norm.weight",), "replicated", _head_dim)
O_PROJ = Rule("self_attention.linear_proj.weight", (_L + "self_attn.o_proj.weight",), "row",
              lambda c: ((c.hidden_size, c.num_attention_heads * c.head_dim),))
POST_ATTN_NORM = Rule("pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), "replicated", _hidden,
                      te_alias="mlp.linear_fc1.layer_norm_weight")
GATE_UP = Rule("mlp.linear_fc1.weight", (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"), "fc1",
               lambda c: ((c.ffn_hidden_size, c.hidden_size),) * 2)
DOWN = Rule("mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), "row",
            lambda c: ((c.hidden_size, c.ffn_hidden_size),))

EMBED_RULE = Rule("embedding.word_embeddings.weight", (EMBED,), "vocab", _vocab)
FINAL_NORM_RULE = Rule("decoder.final_layernorm.weight", (FINAL_NORM,), "replicated", _hidden)
LM_HEAD_RULE = Rule("output_layer.weight", (LM_HEAD,), "vocab", _vocab)


def decoder_layer_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    """A pre-norm SwiGLU decoder layer with RoPE attention: the optional pieces follow the config's
    feature fields (q/k/v biases, per-head q/k RMSNorm), in HF checkpoint order."""
    attention = [QKV] + ([QKV_BIAS] if cfg.qkv_bias else []) + ([Q_NORM, K_NORM] if cfg.qk_layernorm else [])
    return (INPUT_NORM, *attention, O_PROJ, POST_ATTN_NORM, GATE_UP, DOWN)


# --- config.json ------------------------------------------------------------------------------
class HFConfigFields:
    """Read access to one config.json with errors that name the file and the field."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def need(self, field: str):
        if field not in self.raw or self.raw[field] is None:
            raise UnsupportedHFConfig(f"{self.source}: missing field '{field}'")
        return self.raw[field]

    def get(self, field: str, default=None):
        value = self.raw.get(field)
        return default if value is None else value

    def refuse_unless(self, field: str, supported: tuple, why: str = "") -> None:
        """Refuse a field whose value is present and not one of ``supported`` (absent/None is fine)."""
        value = self.raw.get(field)
        if value is not None and value not in supported:
            reason = f"; {why}" if why else ""
            raise UnsupportedHFConfig(
                f"{self.source}: unsupported {field}={value!r} (supported: {', '.join(map(repr, supported))}{reason})"
            )

    def rope(self) -> dict:
        """rope_theta and rope scaling, from the classic fields or transformers 5's rope_parameters."""
        rope = dict(self.raw.get("rope_parameters") or {})
        rope.update(self.raw.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        theta = self.raw.get("rope_theta")  # transformers 5 writes rope_theta: null beside rope_parameters
        rope["rope_theta"] = theta if theta is not None else rope.get("rope_theta", 10000.0)
        return rope

    def refuse_sliding_window(self) -> None:
        """Sliding-window attention is not built here: refuse it by name wherever config.json turns it on."""
        self.refuse_unless("use_sliding_window", (False,), "sliding-window attention is not supported")
        layer_types = self.raw.get("layer_types") or []
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise UnsupportedHFConfig(
                f"{self.source}: unsupported layer_types {other} (supported: 'full_attention' on every layer)"
            )


def common_model_fields(
    f: HFConfigFields, rope_types: tuple[str, ...] = ("default",), default_head_dim: int | None = None
) -> dict:
    """ModelConfig fields every family here reads the same way (sizes, norms, RoPE, dtype, heads)."""
    f.refuse_unless("hidden_act", ("silu",))
    rope = f.rope()
    if rope["rope_type"] not in rope_types:
        raise UnsupportedHFConfig(
            f"{f.source}: unsupported rope_scaling type {rope['rope_type']!r} (supported: {', '.join(rope_types)})"
        )
    scaling = None
    if rope["rope_type"] == "llama3":
        scaling = RopeScaling(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    heads, hidden = f.need("num_attention_heads"), f.need("hidden_size")
    head_dim = f.get("head_dim", default_head_dim)  # the family's transformers default when absent
    dtype = _DTYPE_NAMES.get(str(f.get("torch_dtype") or f.get("dtype") or "float32"), "float32")
    return dict(
        num_layers=f.need("num_hidden_layers"),
        hidden_size=hidden,
        ffn_hidden_size=f.need("intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=f.get("num_key_value_heads", heads),
        kv_channels=head_dim if head_dim is not None and head_dim * heads != hidden else None,
        vocab_size=f.need("vocab_size"),
        max_position_embeddings=f.get("max_position_embeddings", 4096),
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        norm_epsilon=f.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        params_dtype=dtype,
    )


def common_hf_fields(cfg: ModelConfig) -> dict:
    """config.json fields every family here writes the same way (classic rope_theta / rope_scaling
    fields, which transformers 4.x, 5.x and SGLang all read)."""
    raw = {
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.norm_epsilon,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": cfg.params_dtype,
    }
    if cfg.rope_scaling is not None:
        raw["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling.factor,
            "low_freq_factor": cfg.rope_scaling.low_freq_factor,
            "high_freq_factor": cfg.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": cfg.rope_scaling.original_max_position_embeddings,
        }
    return raw


# --- the family interface ---------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    """One HF decoder family. ``name`` is its config.json ``model_type`` and ``ModelConfig.architecture``;
    ``hf_class`` its ``architectures`` entry, which is also the model class SGLang and transformers load."""

    name: str
    hf_class: str
    summary: str
    read_hf: Callable[[HFConfigFields], dict]  # config.json -> ModelConfig kwargs (family fields included)
    write_hf: Callable[[ModelConfig], dict]  # ModelConfig -> the family's config.json fields
    check: Callable[[ModelConfig], str | None] = lambda cfg: None  # what the family cannot express, or None
    features: dict = field(default_factory=dict)  # ModelConfig feature fields the family implies
    layer_rules: Callable[[ModelConfig], tuple[Rule, ...]] = decoder_layer_rules
    experts: bool = False  # a mixture-of-experts family: ModelConfig.moe is set (and only here)
    shared_expert: bool = False  # its MoE layers add a gated shared expert (moe.shared_expert_*: Qwen2-MoE)

    def hf_config(self, cfg: ModelConfig, extra: dict | None = None) -> dict:
        raw = {"architectures": [self.hf_class], "model_type": self.name, **common_hf_fields(cfg),
               **self.write_hf(cfg)}
        for key, value in (extra or {}).items():
            if key in CARRIED_HF_FIELDS:
                raw[key] = value
        return raw
