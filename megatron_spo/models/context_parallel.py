"""Context parallelism (CP) without Transformer Engine: each sequence cut into 2 x CP chunks over the CP ranks.

megatron-core has CP only through TE's attention (its DotProductAttention refuses it). Here the split, the key /
value exchange and the causal attention of each rank's chunks are ours, on the local spec's SDPA core attention
(models/attention.py), so CP runs wherever torch runs: gloo on a CPU, NCCL on GPUs without TE.

The split (megatron-core's, ``get_batch_on_this_cp_rank`` / TE's ``thd_get_partitioned_indices``): a sequence of P
tokens (padded to a multiple of 2 CP) is cut into 2 CP chunks of c = P / (2 CP); rank r holds chunks r and
2 CP - 1 - r, back to back, so every rank does the same causal work. Packed micro-batches (THD) split each
sequence of the pack alike (``Packed.of(..., seq_multiple=2 CP)``); megatron-core's RoPE reads the same split
(``get_pos_emb_on_this_cp_rank`` for padded rows, ``_apply_rotary_pos_emb_thd`` with the padded cu_seqlens).

Keys / values: all-gathered over the CP group in every layer (megatron-core's ``cp_comm_type`` "all_gather"; the
backward reduce-scatters their gradients). Per layer and rank that is (CP - 1) / CP of the sequence's K and V
received, 2 x num_query_groups / TP x head_dim x P elements kept for the backward (the whole sequence's K / V in
place of its own share), against 1 / CP of every other activation. A ring (TE's "p2p") would keep 2 chunks of K / V
at a time; the all-gather is one collective per tensor and overlaps nothing, which gloo cannot do anyway.

The sequence-level part (ours alone): the model's per-token outputs (log-probs, values, entropies) are all-gathered
over CP once per micro-batch (4 bytes a token; ``ContextShard.unpack``), so every algorithm sees whole sequences:
SPO's cumulative Q_t = Q0 + beta sum_{t' <= t} (log pi - log pi_0) across the chunks, Q_T, group baselines, token
normalisation, GAE, exactly as on one rank. Every CP rank computes the same loss; the gather's backward hands each
rank the gradient of its own tokens, and megatron-core's loss scaling (x CP) with DDP's average over DP x CP sums
the CP ranks' weight gradients.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# queries per SDPA call on the CPU (each against a view of one shared additive causal mask: kept for the backward
# once per micro-batch and layer set, bq x (longest sequence + bq) x 4 bytes)
CPU_QUERY_BLOCK = 128


def cp_group():
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


def zigzag(length: int, cp: int, rank: int) -> Tensor:
    """[length / CP] long: the positions of a sequence of ``length`` tokens (a multiple of 2 CP) that CP rank ``rank``
    holds: chunk ``rank`` then chunk 2 CP - 1 - ``rank``."""
    if length % (2 * cp):
        raise ValueError(f"context parallelism: a sequence of {length} tokens does not divide into 2 x {cp} chunks")
    c = length // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


@functools.lru_cache(maxsize=64)
def _stream_split(segments: tuple[int, ...], cp: int) -> tuple[tuple[Tensor, ...], Tensor]:
    """(each rank's positions in a stream of back-to-back ``segments`` (each a multiple of 2 CP), the stream's order
    as positions in the rank-major concatenation of those shares: ``inverse``)."""
    starts = [0]
    for n in segments:
        starts.append(starts[-1] + n)
    shares = tuple(torch.cat([zigzag(n, cp, r) + s for n, s in zip(segments, starts)]) if segments
                   else torch.zeros(0, dtype=torch.long) for r in range(cp))
    gathered = torch.cat(shares)
    inverse = torch.empty_like(gathered)
    inverse[gathered] = torch.arange(gathered.numel())
    return shares, inverse


class _GatherTokens(torch.autograd.Function):
    """[n, ...] on each CP rank -> [CP n, ...] rank-major on every rank; backward: this rank's slice of the gradient
    (every CP rank computes the same function of the gathered tensor, so nothing is summed)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        import torch.distributed as dist

        ctx.rank, ctx.n = dist.get_rank(group), x.shape[0]
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad[ctx.rank * ctx.n:(ctx.rank + 1) * ctx.n], None


@dataclass
class ContextShard:
    """A CP rank's share of a micro-batch's token layout (models/packing.py ``Packed`` or ``Padded``, every sequence a
    multiple of 2 CP tokens), with the layouts' interface: ``gather`` [B, L, ...] -> this rank's tokens [N / CP, ...],
    ``unpack`` this rank's per-token outputs -> the whole micro-batch's [B, L, ...] (CP all-gather), ``model_output``,
    and the model's inputs (``input_ids`` / ``position_ids`` / ``params()`` packed, ``columns`` padded)."""

    whole: object  # Packed | Padded
    local: Tensor  # [N / CP] long: this rank's tokens, as positions in whole's token order
    inverse: Tensor  # [N] long: whole's tokens as positions in the CP-gathered (rank-major) order
    packed: bool
    rank: int
    size: int

    @classmethod
    def of(cls, whole, cp: int, rank: int) -> ContextShard:
        from megatron_spo.models.packing import Packed

        packed = isinstance(whole, Packed)
        if packed:
            segments = tuple((whole.cu_seqlens[1:] - whole.cu_seqlens[:-1]).tolist())
        else:
            b, L = whole.shape
            segments = (L,) * b
        shares, inverse = _stream_split(segments, cp)
        device = whole.input_ids.device if packed else None
        return cls(whole, shares[rank].to(device), inverse.to(device), packed, rank, cp)

    @property
    def num_tokens(self) -> int:
        """This rank's tokens of the micro-batch (padding included)."""
        return self.local.numel()

    # -- the model's inputs -------------------------------------------------------------------------------------
    @property
    def input_ids(self) -> Tensor:
        return self.whole.input_ids[:, self.local]

    @property
    def position_ids(self) -> Tensor:
        return self.whole.position_ids[:, self.local]

    def params(self):
        """PackedSeqParams of the WHOLE pack (cu_seqlens over every rank's tokens, padded: megatron-core's THD RoPE
        and our attention divide them by CP themselves)."""
        p = self.whole.params()
        p.cu_seqlens_q_padded = p.cu_seqlens_kv_padded = p.cu_seqlens_q
        return p

    def columns(self, x: Tensor) -> Tensor:
        """Padded rows [rows, L, ...] -> [rows, L / CP, ...]: this rank's positions of every row."""
        return x[:, self.local[: self.num_tokens // self.whole.shape[0]]]

    # -- outputs ------------------------------------------------------------------------------------------------
    def model_output(self, out: Tensor, rows: int) -> Tensor:
        """The last stage's output -> this rank's tokens [N / CP, ...] in ``local``'s order."""
        if self.packed:
            return out[0]
        b = self.whole.shape[0]
        return out[:b].reshape(b * out.shape[1], *out.shape[2:])

    def gather(self, x: Tensor, fill: float = 0) -> Tensor:
        return self.whole.gather(x, fill)[self.local]

    def unpack(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """This rank's per-token values [N / CP, ...] -> the whole micro-batch's [B, L, ...] on every CP rank."""
        return self.whole.unpack(_GatherTokens.apply(x, cp_group())[self.inverse], fill)


# ---------------------------------------------------------------------------------------------------------------
# The attention of one rank's chunks
# ---------------------------------------------------------------------------------------------------------------
def gather_sequence(x: Tensor, group, inverse: Tensor) -> Tensor:
    """x [s / CP, ...] this rank's share (dim 0) -> [s, ...] every rank's, in the sequence's order (backward: the
    gradient reduce-scattered back to each rank's share)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)[inverse]


@functools.lru_cache(maxsize=8)
def _causal_mask(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """[rows, width + rows] additive mask: 0 where column <= row + width, -inf after. ``mask[:, width - q0:][:, :k]``
    is the causal mask of queries q0 .. q0 + rows - 1 over keys 0 .. k - 1 (a view: one storage for every call)."""
    cols = torch.arange(width + rows, device=device)[None, :]
    allowed = cols <= torch.arange(rows, device=device)[:, None] + width
    return torch.zeros((rows, width + rows), dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))


def causal_block(query: Tensor, key: Tensor, value: Tensor, q_start: int, scale: float, dropout: float) -> Tensor:
    """query [1, np, c, hn] at positions q_start .. q_start + c - 1 of a sequence, key / value [1, ng, q_start + c,
    hn] its positions 0 .. q_start + c - 1 -> [1, np, c, hn], causal (lower-right aligned). On a GPU one SDPA call
    with torch's lower-right causal bias (flash / memory-efficient kernels, no mask); on the CPU blocks of
    CPU_QUERY_BLOCK queries against views of one cached additive mask (the flash kernel takes it)."""
    c, k = query.shape[2], key.shape[2]
    gqa = key.shape[1] != query.shape[1]
    if query.is_cuda:  # not run on a GPU yet (docs/long-sequences.md)
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(c, k),
                                              dropout_p=dropout, scale=scale, enable_gqa=gqa)
    bq = min(CPU_QUERY_BLOCK, c)
    width = 1 << max(0, math.ceil(math.log2(k)))  # a few mask sizes serve every sequence length
    mask = _causal_mask(bq, width, query.dtype, query.device)
    out = []
    for q0 in range(0, c, bq):
        n = min(bq, c - q0)
        end = q_start + q0 + n  # keys this block sees
        view = mask[:n, width - q_start - q0:][:, :end]
        out.append(F.scaled_dot_product_attention(query[:, :, q0:q0 + n], key[:, :, :end], value[:, :, :end],
                                                  attn_mask=view, dropout_p=dropout, scale=scale, enable_gqa=gqa))
    return torch.cat(out, dim=2)


def chunks_attention(query: Tensor, key: Tensor, value: Tensor, length: int, cp: int, rank: int, scale: float,
                     dropout: float) -> Tensor:
    """One sequence: query [1, np, P / CP, hn] this rank's two chunks, key / value [1, ng, P, hn] the whole
    sequence's -> [1, np, P / CP, hn]."""
    c = length // (2 * cp)
    parts = []
    for i, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c
        parts.append(causal_block(query[:, :, i * c:(i + 1) * c], key[:, :, :end], value[:, :, :end], chunk * c,
                                  scale, dropout))
    return torch.cat(parts, dim=2)


def padded_attention(query: Tensor, key: Tensor, value: Tensor, group, scale: float, dropout: float) -> Tensor:
    """Padded rows: query [s / CP, b, np, hn], key / value [s / CP, b, ng, hn] this rank's chunks of every row ->
    [s / CP, b, np * hn]."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    s = query.shape[0] * cp
    _, inverse = _stream_split((s,), cp)
    inverse = inverse.to(query.device)
    k, v = (gather_sequence(x, group, inverse).permute(1, 2, 0, 3) for x in (key, value))  # [b, ng, s, hn]
    q = query.permute(1, 2, 0, 3)
    out = chunks_attention(q, k, v, s, cp, rank, scale, dropout)  # [b, np, s / CP, hn]
    return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def packed_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, group, scale: float,
                     dropout: float) -> Tensor:
    """Packed: query [t / CP, np, hn], key / value [t / CP, ng, hn] this rank's chunks of each sequence of
    cu_seqlens (the whole pack's offsets, each segment a multiple of 2 CP) -> [t / CP, np * hn]."""
    import torch.distributed as dist

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = cu_seqlens.tolist()
    segments = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    _, inverse = _stream_split(segments, cp)
    inverse = inverse.to(query.device)
    k_all, v_all = (gather_sequence(x, group, inverse).transpose(0, 1).unsqueeze(0) for x in (key, value))
    pieces, local = [], 0
    for start, n in zip(bounds[:-1], segments):
        if n == 0:
            continue
        q = query[local:local + n // cp].transpose(0, 1).unsqueeze(0)
        k, v = k_all[:, :, start:start + n], v_all[:, :, start:start + n]
        o = chunks_attention(q, k, v, n, cp, rank, scale, dropout)
        pieces.append(o[0].transpose(0, 1).reshape(n // cp, -1))
        local += n // cp
    return torch.cat(pieces)
