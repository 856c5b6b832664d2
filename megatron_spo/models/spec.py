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


def block_spec(layer, backend: Backend, config, vp_stage: int | None = None):
    """What GPTModel takes as its decoder spec: the layer spec as it is on the TE spec (TE's norm ends the block);
    on the local spec the block's layers with the local spec's RMSNorm as the final norm (megatron-core would build
    WrappedTorchNorm, which refuses sequence parallelism). vp_stage: this chunk's virtual stage (its layer count)."""
    if backend == "transformer_engine":
        return layer
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from megatron_spo.models.norms import SequenceParallelRMSNorm

    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage),
                                      layer_norm=SequenceParallelRMSNorm)


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
    from megatron_spo.models.norms import HeadRMSNorm, SequenceParallelRMSNorm

    layer = spec.submodules  # megatron's WrappedTorchNorm refuses sequence parallelism (models/norms.py)
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
    if model_cfg.qk_layernorm:
        attention = layer.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = HeadRMSNorm
    if attention_kernel == "sdpa":
        from megatron_spo.models.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    if lora is not None:
        from megatron_spo.models.lora import apply_to_spec

        apply_to_spec(spec, lora)
    return spec, backend
