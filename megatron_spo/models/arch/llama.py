"""Llama 2 / 3 / 3.1 / 3.2 / 3.3 (``LlamaForCausalLM``): GQA, SwiGLU, no biases, 'llama3' RoPE scaling,
tied embeddings in the 3.2 1B/3B models."""

from megatron_spo.models.arch.base import Architecture, HFConfigFields, common_model_fields
from megatron_spo.models.config import ModelConfig


def _read(f: HFConfigFields) -> dict:
    f.refuse_unless("attention_bias", (False,), "Llama biases on q/k/v/o are not built here")
    f.refuse_unless("mlp_bias", (False,))
    f.refuse_unless("pretraining_tp", (1,))
    return common_model_fields(f, rope_types=("default", "llama3"))


def _write(cfg: ModelConfig) -> dict:
    return {"attention_bias": False, "mlp_bias": False}


def _check(cfg: ModelConfig) -> str | None:
    if cfg.qkv_bias or cfg.qk_layernorm:
        return "LlamaForCausalLM has no q/k/v-only biases or q/k norms (qkv_bias and qk_layernorm must be false)"
    return None


ARCHITECTURE = Architecture("llama", "LlamaForCausalLM", "Llama 2/3/3.1/3.2/3.3", _read, _write, _check)
