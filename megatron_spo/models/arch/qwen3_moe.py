"""Qwen3-MoE (``Qwen3MoeForCausalLM``: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms, head_dim
of its own, no biases) and in every layer a mixture of experts in place of the MLP: a router ``mlp.gate`` [E, H]
and E SwiGLU experts ``mlp.experts.{e}.gate_proj / up_proj`` [F, H], ``down_proj`` [H, F] (F =
moe_intermediate_size), no shared expert. Each token goes to its top-k experts; norm_topk_prob renormalises
the k weights. Dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step) and multi-token
prediction layers are refused by name, not dropped."""

from megatron_spo.models.arch.base import (
    INPUT_NORM,
    K_NORM,
    O_PROJ,
    POST_ATTN_NORM,
    Q_NORM,
    QKV,
    Architecture,
    HFConfigFields,
    Rule,
    UnsupportedHFConfig,
    common_model_fields,
)
from megatron_spo.models.config import ModelConfig, MoEConfig

DEFAULT_HEAD_DIM = 128  # transformers' Qwen3MoeConfig takes Qwen3's when config.json has no head_dim
_L = "model.layers.{i}."
# fields of other families' multi-token-prediction heads: their tensors would be dropped here
_MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def refuse_dense_layers(f: HFConfigFields) -> None:
    """Every layer here is a MoE layer: dense MLP layers among them and multi-token prediction are refused."""
    f.refuse_unless("decoder_sparse_step", (1,), "dense MLP layers between MoE layers are not built here")
    if f.get("mlp_only_layers", []):
        raise UnsupportedHFConfig(f"{f.source}: unsupported mlp_only_layers={f.raw['mlp_only_layers']!r} "
                                  f"(supported: []; dense MLP layers between MoE layers are not built here)")
    for field in _MTP_FIELDS:
        f.refuse_unless(field, (0,), "multi-token prediction layers are not built here")


def read_moe(f: HFConfigFields, **shared) -> MoEConfig:
    """The routed experts of a Qwen MoE config.json (``shared``: the family's shared-expert fields)."""
    experts = f.raw.get("num_experts", f.raw.get("num_local_experts"))  # transformers 5 writes num_local_experts
    if experts is None:
        f.need("num_experts")
    topk = f.need("num_experts_per_tok")
    if isinstance(topk, int) and isinstance(experts, int) and topk > experts:
        raise UnsupportedHFConfig(f"{f.source}: num_experts_per_tok {topk} is larger than num_experts {experts}")
    aux = float(f.get("router_aux_loss_coef", 0.0)) if f.get("output_router_logits", False) else 0.0
    return MoEConfig(num_experts=experts, router_topk=topk, ffn_hidden_size=f.need("moe_intermediate_size"),
                     norm_topk_prob=bool(f.get("norm_topk_prob", False)),  # transformers' default
                     aux_loss_coeff=aux, **shared)


def write_moe(cfg: ModelConfig) -> dict:
    """read_moe's config.json fields (every layer a MoE layer)."""
    moe = cfg.moe
    return {"decoder_sparse_step": 1, "mlp_only_layers": [], "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.router_topk, "moe_intermediate_size": moe.ffn_hidden_size,
            "norm_topk_prob": moe.norm_topk_prob, "router_aux_loss_coef": moe.aux_loss_coeff,
            "output_router_logits": moe.aux_loss_coeff > 0}


def _read(f: HFConfigFields) -> dict:
    f.refuse_unless("attention_bias", (False,), "Qwen3 biases on q/k/v/o are not built here")
    f.refuse_sliding_window()
    refuse_dense_layers(f)
    if f.get("shared_expert_intermediate_size", 0):
        raise UnsupportedHFConfig(f"{f.source}: unsupported shared_expert_intermediate_size="
                                  f"{f.raw['shared_expert_intermediate_size']!r} (supported: 0; shared experts are "
                                  f"not built here)")
    return {**common_model_fields(f, default_head_dim=DEFAULT_HEAD_DIM), "qk_layernorm": True, "moe": read_moe(f)}


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers, **write_moe(cfg)}


def _check(cfg: ModelConfig) -> str | None:
    if cfg.qkv_bias or not cfg.qk_layernorm or cfg.rope_scaling is not None or cfg.moe is None:
        return "Qwen3MoeForCausalLM has q/k norms, no biases, no rope scaling and experts (qk_layernorm true, " \
               "qkv_bias false, rope_scaling null, moe set)"
    if cfg.moe.shared_expert_ffn_hidden_size is not None:
        return "Qwen3MoeForCausalLM has no shared expert (moe.shared_expert_ffn_hidden_size null)"
    return None


ROUTER = Rule("mlp.router.weight", (_L + "mlp.gate.weight",), "replicated",
              lambda c: ((c.moe.num_experts, c.hidden_size),))


def expert_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    """fc1 (= cat[gate, up], split like a dense fc1 over expert-TP) and fc2 of every expert, by global index.
    megatron's SequentialMLP (local and TE spec alike) names its experts local_experts.{j}, j: the index on the
    EP rank."""
    rules = []
    for e in range(cfg.moe.num_experts):
        x = f"{_L}mlp.experts.{e}."
        rules.append(Rule("mlp.experts.local_experts.{j}.linear_fc1.weight", (x + "gate_proj.weight", x + "up_proj.weight"),
                          "fc1", lambda c: ((c.moe.ffn_hidden_size, c.hidden_size),) * 2,
                          expert=e))
        rules.append(Rule("mlp.experts.local_experts.{j}.linear_fc2.weight", (x + "down_proj.weight",), "row",
                          lambda c: ((c.hidden_size, c.moe.ffn_hidden_size),),
                          expert=e))
    return tuple(rules)


def _layer_rules(cfg: ModelConfig) -> tuple[Rule, ...]:
    return (INPUT_NORM, QKV, Q_NORM, K_NORM, O_PROJ, POST_ATTN_NORM, ROUTER, *expert_rules(cfg))


ARCHITECTURE = Architecture("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE (routed experts, no shared expert)",
                            _read, _write, _check, features={"qk_layernorm": True}, layer_rules=_layer_rules,
                            experts=True)
