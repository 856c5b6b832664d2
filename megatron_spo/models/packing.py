"""Packed sequences: a right-padded micro-batch [B, L] as one stream [1, T] of whole sequences back to back.

    pack = Packed.of(input_ids, lengths, multiple=tp, width=None)   # T = sum(lengths) (+ a tail segment)
    out = model(pack.input_ids, pack.position_ids, None, packed_seq_params=pack.params())
    per_token = pack.unpack(values_T, fill=0)                          # [T, ...] -> [B, L, ...]
    targets_T = pack.gather(targets, fill=-100)                         # [B, L] -> [T]

``Padded((B, L))`` has the same gather / unpack for the padded layout (flat [B * L] tokens), so code downstream of
the model reads one way for both (and ``models/context_parallel.ContextShard``, a CP rank's share of either).

RoPE positions restart at 0 in every sequence (megatron's THD path reads cu_seqlens), and attention never
crosses a sequence boundary (models/attention.py, or TE's THD attention). ``multiple`` rounds T up (sequence
parallelism splits T over TP ranks); ``width`` pads T to a fixed size (the interleaved pipeline schedule needs
one shape per step). The padding is a segment of its own in cu_seqlens, so nothing attends to it or from it.
``seq_multiple`` pads each sequence's own segment (context parallelism: every segment a multiple of 2 x CP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Packed:
    input_ids: Tensor  # [1, T] long
    position_ids: Tensor  # [1, T] long, restarting at 0 per sequence
    cu_seqlens: Tensor  # [n + 1] int32 (n sequences, plus the padding segment when there is one)
    max_seqlen: int
    index: Tensor  # [T_valid] long: flat index b * L + s of each packed token in the [B, L] layout
    shape: tuple[int, int]  # (B, L)
    slots: Tensor | None = None  # [T_valid] long: each of those tokens' place in the stream (None: 0 .. T_valid - 1)

    @classmethod
    def of(cls, input_ids: Tensor, lengths: Tensor, *, multiple: int = 1, width: int | None = None,
           seq_multiple: int = 1) -> Packed:
        """input_ids [B, L] right-padded; lengths [B] valid tokens per row (1 <= length <= L). seq_multiple: each
        sequence's segment padded to a multiple of it (context parallelism cuts every sequence into 2 x CP chunks):
        its padding tokens follow it in its own segment (they see it, nothing of it sees them: causal)."""
        b, L = input_ids.shape
        lengths = lengths.to(device=input_ids.device, dtype=torch.long)
        if lengths.shape != (b,) or bool((lengths < 1).any()) or bool((lengths > L).any()):
            raise ValueError(f"packing: lengths {lengths.tolist()} do not fit rows of {L} tokens")
        keep = torch.arange(L, device=input_ids.device)[None, :] < lengths[:, None]  # [B, L]
        index = keep.reshape(-1).nonzero().squeeze(1)
        segments = -(-lengths // seq_multiple) * seq_multiple  # [B] each sequence's segment
        used = int(segments.sum())
        total = -(-used // multiple) * multiple
        if width is not None:
            if width < used:
                raise ValueError(f"packing: width {width} is below the {used} tokens of the micro-batch")
            total = -(-width // multiple) * multiple
        starts = torch.cumsum(segments, 0) - segments  # [B]
        row, col = index // L, index % L
        slots = None if seq_multiple == 1 else starts[row] + col
        ids = input_ids.new_zeros(total)
        pos = torch.zeros(total, dtype=torch.long, device=input_ids.device)
        # every slot of a segment counts on from its sequence's start (padding too); the tail segment from 0
        seg_of = torch.repeat_interleave(torch.arange(b, device=input_ids.device), segments)
        pos[:used] = torch.arange(used, device=input_ids.device) - starts[seg_of]
        if slots is None:
            ids[:index.numel()] = input_ids.reshape(-1)[index]
        else:
            ids[slots] = input_ids.reshape(-1)[index]
        cuts = [0] + torch.cumsum(segments, 0).tolist()
        if total > used:
            pos[used:] = torch.arange(total - used, device=pos.device)
            cuts.append(total)
        cu = torch.tensor(cuts, dtype=torch.int32, device=input_ids.device)
        max_len = int((cu[1:] - cu[:-1]).max())
        return cls(ids[None, :], pos[None, :], cu, max_len, index, (b, L), slots)

    @property
    def num_tokens(self) -> int:
        """T, the packed length (padding included)."""
        return self.input_ids.shape[1]

    def params(self):
        """megatron's PackedSeqParams (THD) for this pack."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu_seqlens, cu_seqlens_kv=self.cu_seqlens,
                               max_seqlen_q=self.max_seqlen, max_seqlen_kv=self.max_seqlen)

    def model_output(self, out: Tensor, rows: int) -> Tensor:
        """The last stage's output [1, T, ...] -> [T, ...], the stream's tokens."""
        return out[0]

    def gather(self, x: Tensor, fill: float = 0) -> Tensor:
        """[B, L, ...] -> [T, ...]: the packed tokens' values (fill in the padding)."""
        b, L = self.shape
        flat = x.reshape(b * L, *x.shape[2:])[self.index]
        if self.slots is None:
            tail = self.num_tokens - flat.shape[0]
            return torch.cat([flat, flat.new_full((tail, *flat.shape[1:]), fill)]) if tail else flat
        return flat.new_full((self.num_tokens, *flat.shape[1:]), fill).index_copy(0, self.slots, flat)

    def unpack(self, x: Tensor, fill: float = 0.0) -> Tensor:
        """[T, ...] -> [B, L, ...]: each packed token back at its row and position, padding = fill.
        Differentiable (a scatter of the valid rows)."""
        b, L = self.shape
        valid = x[: self.index.numel()] if self.slots is None else x[self.slots]
        out = valid.new_full((b * L, *x.shape[1:]), fill)
        out = out.index_copy(0, self.index, valid)
        return out.view(b, L, *x.shape[1:])


@dataclass
class Padded:
    """The padded layout with Packed's interface: token i of the flat [B * L] order is row i // L, position i % L."""

    shape: tuple[int, int]  # (B, L)

    @property
    def num_tokens(self) -> int:
        return self.shape[0] * self.shape[1]

    def model_output(self, out: Tensor, rows: int) -> Tensor:
        """The last stage's output [rows, L, ...] (rows >= B: padded rows with virtual stages) -> [B * L, ...]."""
        return self.gather(out[: self.shape[0]])

    def gather(self, x: Tensor, fill: float = 0) -> Tensor:
        return x.reshape(self.shape[0] * self.shape[1], *x.shape[2:])

    def unpack(self, x: Tensor, fill: float = 0.0) -> Tensor:
        return x.reshape(*self.shape, *x.shape[1:])
