"""Qwen3 dense (``Qwen3ForCausalLM``): no biases, per-head RMSNorm on queries and keys before RoPE, and a
head_dim (128) independent of hidden_size / heads. MoE (Qwen3MoeForCausalLM) is another architecture."""

from megatron_spo.models.arch.base import Architecture, HFConfigFields, common_model_fields
from megatron_spo.models.config import ModelConfig

DEFAULT_HEAD_DIM = 128  # transformers' Qwen3Config default when config.json has no head_dim


def _read(f: HFConfigFields) -> dict:
    f.refuse_unless("attention_bias", (False,), "Qwen3 biases on q/k/v/o are not built here")
    f.refuse_sliding_window()
    return {**common_model_fields(f, default_head_dim=DEFAULT_HEAD_DIM), "qk_layernorm": True}


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.num_layers}


def _check(cfg: ModelConfig) -> str | None:
    if cfg.qkv_bias or not cfg.qk_layernorm or cfg.rope_scaling is not None:
        return "Qwen3ForCausalLM has q/k norms, no biases and no rope scaling (qk_layernorm true, " \
               "qkv_bias false, rope_scaling null)"
    return None


ARCHITECTURE = Architecture("qwen3", "Qwen3ForCausalLM", "Qwen3 dense", _read, _write, _check,
                            features={"qk_layernorm": True})
