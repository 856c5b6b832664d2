"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's layer plus biases on q, k and v (not o); tied heads
in the 0.5B-3B models, untied from 7B. Sliding-window attention (off in every released config) is refused."""

from megatron_spo.models.arch.base import Architecture, HFConfigFields, common_model_fields
from megatron_spo.models.config import ModelConfig


def _read(f: HFConfigFields) -> dict:
    f.refuse_sliding_window()
    return {**common_model_fields(f), "qkv_bias": True}


def _write(cfg: ModelConfig) -> dict:
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.num_layers}


def _check(cfg: ModelConfig) -> str | None:
    if not cfg.qkv_bias or cfg.qk_layernorm or cfg.rope_scaling is not None:
        return "Qwen2ForCausalLM has q/k/v biases, no q/k norms and no rope scaling (qkv_bias true, " \
               "qk_layernorm false, rope_scaling null)"
    return None


ARCHITECTURE = Architecture("qwen2", "Qwen2ForCausalLM", "Qwen2 / Qwen2.5 dense", _read, _write, _check,
                            features={"qkv_bias": True})
