"""Qwen2-MoE (``Qwen2MoeForCausalLM``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases, head_dim
= hidden / heads) and in every layer routed experts beside one shared expert. The routed part is Qwen3-MoE's (router
``mlp.gate`` [E, H], E SwiGLU experts of moe_intermediate_size, top-k of a softmax, norm_topk_prob); the shared expert
``mlp.shared_expert.gate_proj / up_proj / down_proj`` (shared_expert_intermediate_size) sees every token and its
output is scaled by sigmoid(``mlp.shared_expert_gate`` [1, H] . x) before it is added: megatron-core's
SharedExpertMLP with moe_shared_expert_gate (the same math; its gate_weight [1, H]; the shared expert split over TP
like a dense MLP, not over EP). Dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step), a head_dim of
its own (transformers 4 and SGLang take hidden / heads) and sliding windows are refused by name."""

from megatron_spo.models.arch.base import (
    INPUT_NORM,
    O_PROJ,
    POST_ATTN_NORM,
    QKV,
    QKV_BIAS,
    Architecture,
    HFConfigFields,
    Rule,
    UnsupportedHFConfig,
    common_model_fields,
)
from megatron_spo.models.arch.qwen3_moe import ROUTER, expert_rules, read_moe, refuse_dense_layers, write_moe
from megatron_spo.models.config import ModelConfig

_L = "model.layers.{i}."


def _read(f: HFConfigFields) -> dict:
    f.refuse_sliding_window()
    refuse_dense_layers(f)
    heads, hidden = f.need("num_attention_heads"), f.need("hidden_size")
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        f.refuse_unless("head_dim", (hidden // heads,), "Qwen2-MoE's head_dim is hidden_size / num_attention_heads")
    shared = f.need("shared_expert_intermediate_size")
    if not isinstance(shared, int) or shared <= 0:
        raise UnsupportedHFConfig(f"{f.source}: unsupported shared_expert_intermediate_size={shared!r} (supported: "
                                  f"a positive size; Qwen2MoeForCausalLM always builds its shared expert)")
    moe = read_moe(f, shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    return {**common_model_fields(f), "qkv_bias": bool(f.get("qkv_bias", True)), "moe": moe}


def _write(cfg: ModelConfig) -> dict:
    return {"qkv_bias": cfg.qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers, **write_moe(cfg),
            "shared_expert_intermediate_size": cfg.moe.shared_expert_ffn_hidden_size}


def _check(cfg: ModelConfig) -> str | None:
    if cfg.qk_layernorm or cfg.rope_scaling is not None or cfg.kv_channels is not None:
        return "Qwen2MoeForCausalLM has no q/k norms, no rope scaling and head_dim = hidden_size / " \
               "num_attention_heads (qk_layernorm false, rope_scaling null, kv_channels null)"
    if cfg.moe is None or cfg.moe.shared_expert_ffn_hidden_size is None or not cfg.moe.shared_expert_gate:
        return "Qwen2MoeForCausalLM has experts and a gated shared expert (moe set with " \
               "shared_expert_ffn_hidden_size and shared_expert_gate true)"
    return None


def _shared(c: ModelConfig) -> int:
    return c.moe.shared_expert_ffn_hidden_size


_S = _L + "mlp.shared_expert."
SHARED_FC1 = Rule("mlp.shared_experts.linear_fc1.weight", (_S + "gate_proj.weight", _S + "up_proj.weight"), "fc1",
                  lambda c: ((_shared(c), c.hidden_size),) * 2)
SHARED_FC2 = Rule("mlp.shared_experts.linear_fc2.weight", (_S + "down_proj.weight",), "row",
                  lambda c: ((c.hidden_size, _shared(c)),))
SHARED_GATE = Rule("mlp.shared_experts.gate_weight", (_L + "mlp.shared_expert_gate.weight",), "replicated",
                   lambda c: ((1, c.hidden_size),))


def _layer_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    attention = (QKV, QKV_BIAS) if cfg.qkv_bias else (QKV,)
    return (INPUT_NORM, *attention, O_PROJ, POST_ATTN_NORM, ROUTER, *expert_rules(cfg),
            SHARED_FC1, SHARED_FC2, SHARED_GATE)


ARCHITECTURE = Architecture("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE (routed experts + a gated shared expert)",
                            _read, _write, _check, features={"qkv_bias": True}, layer_rules=_layer_rules,
                            experts=True, shared_expert=True)
