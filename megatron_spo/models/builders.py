"""megatron-core GPT models of the registered families (models/arch/): policy, frozen reference, PPO value model.

All builders return a list of model chunks (one per virtual pipeline stage; one chunk without
virtual pipelining), built for THIS rank's place in the TP/PP layout. Call ``init_parallel`` first.

    policy = build_policy(model_cfg, parallel_cfg)            # trainable, list[LlamaGPTModel]
    reference = build_reference(model_cfg, parallel_cfg)      # same layout, requires_grad False, eval()
    value = build_value_model(model_cfg, parallel_cfg)        # last stage outputs values [B, S]

Last-stage outputs of ``LlamaGPTModel.forward``:
  - default: logits [B, S, V_local] (TP shard of the PADDED vocab) with padded columns set to -inf, so
    they never carry probability mass in a softmax or loss;
  - with ``output_hidden_states(chunks)`` active: final hidden states [B, S, H] (after the final
    RMSNorm, before the LM head). Pair them with ``lm_head_weight(chunk)`` ([V_local, H], rows of the
    padded vocab owned by this TP rank: rank r owns [r * V_local, (r + 1) * V_local)) and pass
    ``valid_vocab_size=model_cfg.vocab_size`` to the fused log-prob op so padded rows are masked.
    The hidden states are the full sequence on every TP rank and are handed out as they are (no
    megatron copy-to-TP region): ``megatron_spo.ops.token_logprobs`` all-reduces grad_hidden over TP
    itself, so the trainer must not add another all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_spo.config import ConfigError
from megatron_spo.models.config import ModelConfig, ParallelConfig
from megatron_spo.models.cpu_shims import apply_cpu_shims, apply_no_te_shims
from megatron_spo.models.lora import LoraConfig
from megatron_spo.models.spec import Backend, block_spec, layer_spec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def transformer_config(model_cfg: ModelConfig, parallel_cfg: ParallelConfig, *, init_weights: bool = True):
    """megatron TransformerConfig for the config's decoder (family features: q/k/v bias, q/k norm,
    head_dim) under the given layout.

    init_weights=False skips random initialisation (weights are loaded right after, e.g. conversion).
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = not torch.cuda.is_available()
    dtype = _DTYPES[model_cfg.params_dtype]
    return TransformerConfig(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.ffn_hidden_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_query_groups,
        kv_channels=model_cfg.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_cfg.qkv_bias,
        qk_layernorm=model_cfg.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=parallel_cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel_cfg.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel_cfg.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel_cfg.sequence_parallel,
        context_parallel_size=parallel_cfg.context_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        fp8="hybrid" if model_cfg.fp8 else None,
        use_cpu_initialization=on_cpu,
        perform_initialization=init_weights,
        recompute_granularity=parallel_cfg.recompute_granularity,
        recompute_method=parallel_cfg.recompute_method,
        recompute_num_layers=parallel_cfg.recompute_num_layers,
        recompute_modules=parallel_cfg.recompute_modules,
        # gloo: batched isend/irecv gives wrong gradients with interleaved PP; plain p2p is exact
        # (docs/engineering-notes.md, "Interleaved pipeline and batched p2p on gloo").
        batch_p2p_comm=not on_cpu,
        batch_p2p_sync=not on_cpu,
        expert_model_parallel_size=parallel_cfg.expert_model_parallel_size,
        **moe_config(model_cfg, parallel_cfg.expert_model_parallel_size),
    )


def moe_config(model_cfg: ModelConfig, expert_parallel: int = 1) -> dict:
    """megatron's MoE fields for the config's experts ({} for a dense model). Routing replay is always built (one
    RouterReplay per router, idle until models/routing_replay.py gives it routes): it costs nothing unused."""
    moe = model_cfg.moe
    if moe is None:
        return {}
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,  # None: no shared expert
        moe_shared_expert_gate=moe.shared_expert_gate,  # its output x sigmoid(gate_weight [1, H] . x)
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not moe.norm_topk_prob,  # softmax over all experts, then top-k: weights not renormalised
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_token_dispatcher_type=moe.token_dispatcher if moe.token_dispatcher != "auto" else (
            "alltoall" if expert_parallel > 1 else "allgather"),
        moe_grouped_gemm=False,  # SequentialMLP: one expert after another (grouped GEMMs need TE or grouped_gemm)
        moe_enable_routing_replay=True,
    )


def _gpt_model_class():
    from megatron.core.models.gpt import GPTModel

    class LlamaGPTModel(GPTModel):
        """GPTModel whose last stage masks padded vocab logits, or returns final hidden states."""

        valid_vocab_size: int
        return_hidden_states: bool = False

        def _postprocess(self, hidden_states, labels=None, runtime_gather_output=None, **kwargs):
            if not self.post_process or kwargs.get("inference_context") is not None:
                return super()._postprocess(
                    hidden_states, labels=labels, runtime_gather_output=runtime_gather_output, **kwargs
                )
            if self.return_hidden_states:  # [S, B, H] -> [B, S, H]
                return self._full_sequence(hidden_states).transpose(0, 1).contiguous()
            return self._logits_or_loss(hidden_states, labels, runtime_gather_output)

        def _logits_or_loss(self, hidden_states, labels, runtime_gather_output):
            weight = (
                self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
            )
            logits, _ = self.output_layer(
                hidden_states, weight=weight, runtime_gather_output=runtime_gather_output
            )
            gathered = (
                runtime_gather_output if runtime_gather_output is not None else not self.parallel_output
            )
            start = 0 if gathered else self.output_layer_vocab_start()
            logits = mask_padded_logits(logits, start, self.valid_vocab_size)
            if labels is None:
                return logits.transpose(0, 1).contiguous()
            return self.compute_language_model_loss(labels, logits)

        def _full_sequence(self, hidden_states):
            """Undo sequence parallelism (GPU only). The gradient arriving here is already complete on
            every TP rank (the fused log-prob op all-reduces grad_hidden; the value head is replicated),
            so the backward only splits it: tensor_parallel_output_grad=False."""
            if not self.config.sequence_parallel:
                return hidden_states
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            return gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)

        def output_layer_vocab_start(self) -> int:
            from megatron.core import parallel_state

            v_local = self.vocab_size // parallel_state.get_tensor_model_parallel_world_size()
            return parallel_state.get_tensor_model_parallel_rank() * v_local

    class LlamaValueModel(LlamaGPTModel):
        """Llama trunk with a scalar value head on the last stage: outputs values [B, S] (fp32)."""

        def _postprocess(self, hidden_states, labels=None, runtime_gather_output=None, **kwargs):
            if not self.post_process:
                return hidden_states
            values = self.value_head(self._full_sequence(hidden_states)).squeeze(-1)  # [S, B]
            return values.transpose(0, 1).float().contiguous()

        def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
            # LanguageModule looks up output_layer.weight on the last stage; a value model has none.
            post_process = self.post_process
            self.post_process = False
            try:
                return super().sharded_state_dict(prefix, sharded_offsets, metadata)
            finally:
                self.post_process = post_process

    return LlamaGPTModel, LlamaValueModel


_CLASSES: tuple | None = None


def _classes():
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _gpt_model_class()
    return _CLASSES


def mask_padded_logits(logits: Tensor, vocab_start: int, valid_vocab_size: int) -> Tensor:
    """Set logits of padded vocabulary entries (global index >= valid_vocab_size) to -inf.

    logits: [..., V_local] covering global vocab ids [vocab_start, vocab_start + V_local).
    """
    v_local = logits.shape[-1]
    n_valid = max(0, min(v_local, valid_vocab_size - vocab_start))
    if n_valid == v_local:
        return logits
    ids = torch.arange(v_local, device=logits.device)
    return logits.masked_fill(ids >= n_valid, float("-inf"))


def _llama3_inv_freq(base_inv_freq: Tensor, model_cfg: ModelConfig) -> Tensor:
    """HF 'llama3' rope scaling with all four parameters (megatron hard-codes three of them)."""
    import math

    rs = model_cfg.rope_scaling
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / base_inv_freq
    scaled = torch.where(wavelen > low_wavelen, base_inv_freq / rs.factor, base_inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _build_chunks(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    cls,
    spec_backend: Backend | None,
    init_weights: bool = True,
    lora: LoraConfig | None = None,
):
    apply_cpu_shims()
    if model_cfg.moe is not None:
        apply_no_te_shims()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ConfigError("models: call megatron_spo.models.parallel.init_parallel() before building a model")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (parallel_cfg.tensor_model_parallel_size, parallel_cfg.pipeline_model_parallel_size):
        raise ConfigError(
            f"models: parallel config asks TP={parallel_cfg.tensor_model_parallel_size} "
            f"PP={parallel_cfg.pipeline_model_parallel_size} but the process groups are TP={tp} PP={pp}"
        )
    config = transformer_config(model_cfg, parallel_cfg, init_weights=init_weights)
    spec, backend = layer_spec(model_cfg, spec_backend, parallel_cfg.attention_kernel, lora)
    vpp = parallel_cfg.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = cls(
            config=config,
            transformer_layer_spec=block_spec(spec, backend, config, stage),
            vocab_size=model_cfg.padded_vocab_size(tp),
            max_sequence_length=model_cfg.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=model_cfg.rope_theta,
            rope_scaling=model_cfg.rope_scaling is not None,
            rope_scaling_factor=model_cfg.rope_scaling.factor if model_cfg.rope_scaling else 8.0,
            vp_stage=stage,
        )
        model.valid_vocab_size = model_cfg.vocab_size
        model.model_cfg = model_cfg  # hf_map reads the family's rule table from it
        if model.pre_process:
            model.embedding.register_forward_hook(_standard_strides)
        if model_cfg.rope_scaling is not None:
            rope = model.rotary_pos_emb
            dim = model_cfg.head_dim
            base = 1.0 / (
                model_cfg.rope_theta
                ** (torch.arange(0, dim, 2, dtype=torch.float32, device=rope.inv_freq.device) / dim)
            )
            rope.inv_freq = _llama3_inv_freq(base, model_cfg)
            model.rotary_pos_emb_cache.clear()
        _cast_to_params_dtype(model, config.params_dtype)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _standard_strides(module, args, output: Tensor) -> Tensor:
    """The embedding's [S, B, H] output with row-major strides. megatron transposes [B, S, H] and calls
    .contiguous(), which leaves strides (H, S * H, 1) when B = 1 (a size-1 dim does not count), and torch.matmul
    folds such a 3-D input into one GEMM only when the weight requires grad: a frozen model (the reference) then
    ran S batched [1, H] GEMMs, slower and rounding differently from the policy's, so a packed micro-batch's
    reference log-probs differed from the identical policy's in the last bits."""
    row_major = [1]
    for size in reversed(output.shape[1:]):
        row_major.insert(0, row_major[0] * size)
    return output if list(output.stride()) == row_major else output.clone(memory_format=torch.contiguous_format)


def _cast_to_params_dtype(model, dtype: torch.dtype) -> None:
    """Every floating-point parameter and buffer in ``dtype``, as megatron-LM's ``Float16Module`` makes them
    (its __init__ is ``module.bfloat16()`` / ``module.half()``; megatron-core 0.16 transformer/module.py).

    The local spec's norms are ``torch.nn.RMSNorm`` made without a dtype (``WrappedTorchNorm``), so in a bf16
    model they would stay fp32; megatron's mixed-precision optimizer then keeps them apart from the bf16
    params, and its sharded state dict numbers only the bf16 ones ("Param id N does not match any model
    sharded param" on checkpoint save). The wrapper itself is not used: its forward upcasts the last stage's
    output to fp32, and that output is the final hidden states, which the fused log-prob op takes in the LM
    head's dtype (it accumulates in fp32 itself); its input cast has nothing to do (token and position ids).
    The rotary ``inv_freq`` is a plain attribute, not a buffer: it stays fp32, as under Float16Module."""
    if dtype != torch.float32:
        model.to(dtype=dtype)


def build_policy(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    spec_backend: Backend | None = None,
    init_weights: bool = True,
    lora: LoraConfig | None = None,
    lora_seed: int = 0,
):
    """Trainable Llama policy: list of model chunks for this rank (one per virtual pipeline stage).

    With ``lora`` (models/lora.py) the target linears carry adapters, A drawn from ``lora_seed`` alike in every
    layout and B zero (the policy starts as the base), and only the adapters require grad."""
    llama_cls, _ = _classes()
    chunks = _build_chunks(model_cfg, parallel_cfg, llama_cls, spec_backend, init_weights, lora)
    if lora is not None:
        from megatron_spo.models import lora as adapters

        adapters.init_adapters(chunks, lora_seed)
        adapters.freeze_base(chunks)
    return chunks


def build_reference(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    spec_backend: Backend | None = None,
    init_weights: bool = True,
):
    """Frozen reference: the policy's layout, parameters with requires_grad=False, eval mode.

    Never hand these to an optimizer (nothing to optimise, so no optimizer state exists for them).
    """
    chunks = build_policy(model_cfg, parallel_cfg, spec_backend=spec_backend, init_weights=init_weights)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def build_value_model(
    model_cfg: ModelConfig,
    parallel_cfg: ParallelConfig,
    *,
    spec_backend: Backend | None = None,
    init_weights: bool = True,
):
    """PPO value model: the Llama trunk plus a scalar head (replicated over TP) on the last stage."""
    _, value_cls = _classes()
    chunks = _build_chunks(model_cfg, parallel_cfg, value_cls, spec_backend, init_weights)
    for chunk in chunks:
        if chunk.post_process:
            chunk.output_layer = None
            head = torch.nn.Linear(model_cfg.hidden_size, 1, bias=True, dtype=_DTYPES[model_cfg.params_dtype])
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            chunk.value_head = head.to(chunk.decoder.final_layernorm.weight.device)
    return chunks


# ---------------------------------------------------------------------------------------------
# Access for the trainer: final hidden states and the LM-head shard
# ---------------------------------------------------------------------------------------------
@contextlib.contextmanager
def output_hidden_states(model_chunks) -> Iterator[None]:
    """Within this context the last stage returns final hidden states [B, S, H] instead of logits."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    previous = [_unwrap(c).return_hidden_states for c in chunks]
    for c in chunks:
        _unwrap(c).return_hidden_states = True
    try:
        yield
    finally:
        for c, prev in zip(chunks, previous):
            _unwrap(c).return_hidden_states = prev


def gpt_hidden_states(
    model, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask=None
) -> Tensor:
    """One chunk's forward returning final hidden states [B, S, H] (last stage; PP=1 or a pipeline
    schedule's forward step). Non-last stages return their activations [S, B, H] as usual."""
    if position_ids is None:
        position_ids = default_position_ids(input_ids)
    with output_hidden_states(model):
        return model(input_ids, position_ids, attention_mask)


def lm_head_weight(model) -> Tensor:
    """This TP rank's LM-head shard [V_local, H] of the padded vocab (last pipeline stage only)."""
    inner = _unwrap(model)
    if not inner.post_process:
        raise ValueError(
            "lm_head_weight: this model chunk is not the last pipeline stage (it has no LM head)"
        )
    if inner.share_embeddings_and_output_weights:
        return inner.shared_embedding_or_output_weight()
    return inner.output_layer.weight


def lm_head_vocab_start(model) -> int:
    """Global vocab id of row 0 of ``lm_head_weight(model)``."""
    return _unwrap(model).output_layer_vocab_start()


def default_position_ids(input_ids: Tensor) -> Tensor:
    """[B, S] positions 0..S-1."""
    b, s = input_ids.shape
    return torch.arange(s, device=input_ids.device).unsqueeze(0).expand(b, s)


def _unwrap(model):
    """Strip DDP / Float16Module wrappers (anything with a .module attribute)."""
    while hasattr(model, "module"):
        model = model.module
    return model
