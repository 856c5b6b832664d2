"""Mistral 7B v0.2 / v0.3 and relatives (``MistralForCausalLM``): Llama's layer, optional explicit
head_dim. A sliding window shorter than the context (v0.1's 4096) changes attention and is refused."""

from megatron_spo.models.arch.base import (
    Architecture,
    HFConfigFields,
    UnsupportedHFConfig,
    common_model_fields,
)
from megatron_spo.models.config import ModelConfig

TRANSFORMERS_DEFAULT_WINDOW = 4096  # MistralConfig applies this when config.json has no sliding_window


def _read(f: HFConfigFields) -> dict:
    fields = common_model_fields(f)
    window = f.raw.get("sliding_window", TRANSFORMERS_DEFAULT_WINDOW)
    if window is not None and window < fields["max_position_embeddings"]:
        raise UnsupportedHFConfig(
            f"{f.source}: unsupported sliding_window={window} (shorter than max_position_embeddings "
            f"{fields['max_position_embeddings']}; sliding-window attention is not built here. Setting it to "
            f"null changes the model beyond {window} tokens)"
        )
    return fields


def _write(cfg: ModelConfig) -> dict:
    return {"sliding_window": None}


def _check(cfg: ModelConfig) -> str | None:
    if cfg.qkv_bias or cfg.qk_layernorm or cfg.rope_scaling is not None:
        return "MistralForCausalLM has no biases, q/k norms or rope scaling (qkv_bias and qk_layernorm " \
               "false, rope_scaling null)"
    return None


ARCHITECTURE = Architecture("mistral", "MistralForCausalLM", "Mistral 7B v0.2/v0.3", _read, _write, _check)
