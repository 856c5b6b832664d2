"""Core attention for the local (no Transformer Engine) layer spec that never materialises [s, s] scores.

megatron-core's local ``DotProductAttention`` builds [b * heads, sq, sk] scores (memory quadratic in the
sequence) and refuses packed sequences. ``SDPAttention`` takes its place in the spec's ``core_attention``
slot with the same constructor and forward signature (megatron-core 0.16-0.19, ``CoreAttentionBuilder``):

    sbhd: query [sq, b, np, hn], key / value [sk, b, ng, hn] (GQA groups not expanded) -> [sq, b, np * hn]
    thd:  (packed_seq_params.qkv_format == "thd") query [t, np, hn], key / value [t, ng, hn] -> [t, np * hn]

np / ng are this tensor-parallel rank's query heads / key-value groups. The kernel is torch's
scaled_dot_product_attention (flash / memory-efficient / cuDNN on a GPU, the flash kernel on a CPU), causal,
with ``enable_gqa`` so K/V are not repeated. Packed sequences run each sequence of the pack on its own: torch's
varlen flash kernel on a GPU in half precision, else one SDPA call per sequence (exact, memory linear).
Under context parallelism (config.context_parallel_size > 1) each rank holds 2 chunks of every sequence and attends
them to the whole sequence's keys / values, all-gathered over the CP group (models/context_parallel.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _varlen_causal():
    """f(query [t, np, hn], key / value [t, ng, hn], cu_seqlens int32 [n + 1], max_len, scale) -> [t, np, hn]:
    torch's varlen flash kernel (CUDA, half precision), causal, across the signatures torch has had; None
    where torch has no varlen_attn."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except (ImportError, RuntimeError, OSError):
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:  # torch >= 2.10: (-1, 0) is causal
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    native_gqa = "enable_gqa" in params

    def run(query, key, value, cu, max_len, scale):
        kwargs = dict(causal)
        if key.shape[1] != query.shape[1]:
            if native_gqa:
                kwargs["enable_gqa"] = True
            else:  # expand the groups for a kernel that takes equal heads
                rep = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        return varlen_attn(query, key, value, cu, cu, max_len, max_len, scale=scale, **kwargs)

    return run


def _tp_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "tp", None) is not None:
        return pg_collection.tp.size()
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_world_size()


def _cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def _module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SDPAttention(_module_base()):
    """Causal self-attention by torch's scaled_dot_product_attention (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core.transformer.enums import AttnMaskType

        # context parallelism: this rank's chunks against the whole sequence's keys (megatron's CP group by default)
        self.cp_size = config.context_parallel_size
        self.cp_group = getattr(pg_collection, "cp", None) if self.cp_size > 1 else None
        if getattr(config, "window_size", None) is not None:
            raise ValueError("SDPAttention: sliding-window attention (window_size) is not supported")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"SDPAttention: softmax_type {config.softmax_type!r} is not supported (vanilla only)")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"SDPAttention: attention mask type {attn_mask_type} is not supported (causal only)")
        tp = _tp_size(pg_collection)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads = config.num_attention_heads // tp
        self.groups = max(1, config.num_query_groups // tp)
        self.head_dim = config.kv_channels
        # megatron's query-key layer scaling divides the scale by layer_number and multiplies it back inside
        # its fp32 softmax: the same attention, so the plain scale is used
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.current_max_attn_logits = None  # megatron's qk-clip reads it; SDPA does not compute the logits

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention: attention_bias is not supported")
        dropout = self.dropout_p if self.training else 0.0
        if self.cp_size > 1:
            return self._context_parallel(query, key, value, attention_mask, packed_seq_params, dropout)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params, dropout)
        if packed_seq_params is not None:
            raise ValueError(f"SDPAttention: packed format {packed_seq_params.qkv_format!r} is not supported (thd)")
        sq, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
        mask = None
        if attention_mask is not None:  # megatron's convention: True = masked out; SDPA's: True = attend
            causal = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - sq)
            mask = ~attention_mask.bool() & causal
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None,
                                             scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)  # [sq, b, np * hn]

    def _context_parallel(self, query: Tensor, key: Tensor, value: Tensor, attention_mask, params,
                          dropout: float) -> Tensor:
        """This CP rank's chunks of each sequence against the whole sequence's keys / values (models/
        context_parallel.py): packed [t / CP, ...] by the whole pack's cu_seqlens, or padded rows [s / CP, b, ...]."""
        from megatron_spo.models import context_parallel as cp

        if attention_mask is not None:
            raise ValueError("SDPAttention: context parallelism takes causal attention without a padding mask")
        group = self.cp_group if self.cp_group is not None else _cp_group()
        if params is None:
            return cp.padded_attention(query, key, value, group, self.softmax_scale, dropout)
        if params.qkv_format != "thd":
            raise ValueError(f"SDPAttention: packed format {params.qkv_format!r} is not supported (thd)")
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        return cp.packed_attention(query, key, value, cu, group, self.softmax_scale, dropout)

    def _packed(self, query: Tensor, key: Tensor, value: Tensor, params, dropout: float) -> Tensor:
        """query [t, np, hn], key / value [t, ng, hn]: each sequence of cu_seqlens attends to itself."""
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        if not torch.equal(cu_q, cu_kv):
            raise ValueError("SDPAttention: packed self-attention needs cu_seqlens_q == cu_seqlens_kv")
        whole = int(cu_q[-1]) == query.shape[0]  # the kernel leaves rows past the last sequence unwritten
        if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and dropout == 0.0 and whole:
            varlen = _varlen_causal()
            if varlen is not None:
                cu = cu_q.to(device=query.device, dtype=torch.int32)
                max_len = int(params.max_seqlen_q or int((cu[1:] - cu[:-1]).max()))
                out = varlen(query, key, value, cu, max_len, self.softmax_scale)
                return out.reshape(out.shape[0], -1)
        bounds = cu_q.tolist()
        gqa = key.shape[1] != query.shape[1]
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end == start:
                continue
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))  # [1, h, s, hn]
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale,
                                               enable_gqa=gqa)
            pieces.append(o[0].transpose(0, 1).reshape(end - start, -1))
        if bounds[-1] < query.shape[0]:  # tokens past the last sequence (padding of the pack) attend to nothing
            pieces.append(query.new_zeros(query.shape[0] - bounds[-1], query.shape[1] * query.shape[2]))
        return torch.cat(pieces)
