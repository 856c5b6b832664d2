"""Which transformer layer spec to build: Transformer Engine (FP8-capable) or megatron's local modules.

One guarded probe (``extras.transformer_engine()``: TE imports AND a GPU is present, catching
ImportError, RuntimeError and OSError) decides. Both specs write the same dist-checkpoint keys (the
local spec maps its norms onto TE's fused names), so a checkpoint moves between them unchanged.
The local spec's core attention is ``attention_kernel``: "sdpa" (models/attention.py: torch's
scaled_dot_product_attention, memory linear in tokens, packed sequences) or "dot_product" (megatron-core's
DotProductAttention: [s, s] scores, padded batches only). The TE spec keeps TE's attention.
"""

from __future__ import annotations

from typing import Literal

from megatron_spo import extras
from megatron_spo.config import ConfigError
from megatron_spo.models.config import ModelConfig
from megatron_spo.models.lora import LoraConfig

Backend = Literal["transformer_engine", "local"]
AttentionKernel = Literal["sdpa", "dot_product"]


def spec_backend(prefer: Backend | None = None) -> Backend:
    """'transformer_engine' when usable (or asked for and usable), else 'local'."""
    te_usable = extras.transformer_engine() is not None
    if prefer == "transformer_engine" and not te_usable:
        raise ConfigError(
            "transformer_engine layer spec asked for, but transformer-engine or a GPU is not usable"
        )
    if prefer == "local":
        return "local"
    return "transformer_engine" if te_usable else "local"


def layer_spec(model_cfg: ModelConfig, prefer: Backend | None = None, attention_kernel: AttentionKernel = "sdpa",
               lora: LoraConfig | None = None):
    """(ModuleSpec for one decoder layer of the config's family, backend name). FP8 needs the TE spec.

    With ``lora`` the local spec, its target linears carrying adapters (models/lora.py): TE's linear_qkv and
    linear_fc1 fuse the input norm, so an adapter there needs the norm's output (not written yet)."""
    if lora is not None and model_cfg.moe is not None:
        raise ConfigError("lora: adapters on mixture-of-experts layers are not built (model.moe is set)")
    if lora is not None:
        if prefer == "transformer_engine":
            raise ConfigError("lora: adapters are built on the local layer spec, not transformer_engine's")
        if model_cfg.fp8:
            raise ConfigError("lora: adapters are built on the local layer spec, which has no FP8 (model.fp8)")
        prefer = "local"
    backend = spec_backend(prefer)
    if model_cfg.fp8 and backend != "transformer_engine":
        raise ConfigError("model.fp8 needs the transformer_engine layer spec (transformer-engine + a GPU)")
    from megatron.core.models.gpt import gpt_layer_specs

    experts = model_cfg.moe.num_experts if model_cfg.moe is not None else None  # MoE: SequentialMLP (TE: of TE linears)
    if backend == "transformer_engine":  # GPU path: not exercised on the CPU test machine
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=model_cfg.qk_layernorm), backend
    spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                                    normalization="RMSNorm", qk_layernorm=model_cfg.qk_layernorm)
    if attention_kernel == "sdpa":
        from megatron_spo.models.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if lora is not None:
        from megatron_spo.models.lora import apply_to_spec

        apply_to_spec(spec, lora)
    return spec, backend
