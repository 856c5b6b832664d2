"""Fused LM-head log-probabilities of the taken tokens: chunked, vocabulary-parallel, never [N x V].

    logp = token_logprobs(hidden, weight, targets)            # hidden [N, H], weight [V_local, H], targets [N]
    logp, entropy = token_logprobs(..., return_entropy=True)  # both [N] fp32

The forward pass walks blocks of logits (a vocabulary tile x a chunk of tokens), computes each block with
one GEMM into a reused fp32 buffer, and folds it into per-token online-softmax statistics: running max m,
sum s = sum exp(z - m), t = sum exp(z - m) * z (for the entropy) and the target logit. Nothing of size
N x V survives a block. The backward pass recomputes each block's logits and turns them in place into
dL/dz = g * (onehot - p) + g_H * p * (E_p[z] - z), then accumulates grad_hidden += dz @ W_tile and
grad_weight_tile += dz^T @ hidden_chunk. Without an entropy gradient the block holds only p and the
per-token factors (g, onehot) are applied to N rows outside the blocks (see _recompute_gradients).
Peak extra memory: one block of chunk_size x vocab_tile fp32, bounded by ``max_block_bytes`` (on a GPU also its
bf16 copy, the gradient GEMMs' operand; with entropy on CPU, a 4 MiB scratch that its per-element terms use a slab
of rows at a time), plus grad_hidden's fp32 accumulator, narrowed to the model dtype inside its own storage.
On an H200 at N=16384, H=4096, V=128256 (bf16): 1.34 GiB with the gradients, 0.124 s forward + backward
(docs/gpu/report-2026-11-28-h200.md).

Tensor parallelism (megatron's VocabParallel layout): rank r holds rows [r * V_local, (r + 1) * V_local)
of the LM head. Each rank computes its local statistics; max is all-reduced, then the rescaled sums and
the target logit (non-zero only on the owning rank) are all-reduced in one call. In the backward pass each
rank's grad_hidden is a partial sum over its vocabulary shard and is all-reduced here, so pass the LM
head's input as it is (do NOT also route it through megatron's copy_to_tensor_model_parallel_region).

Vocabulary padding: rows at global index >= valid_vocab_size are never multiplied, so they cannot enter the
softmax; their weight gradient is 0. Targets equal to ``ignore_index`` give log-prob 0, entropy 0 and no
gradient. bf16/fp16 inputs: GEMMs accumulate in fp32 with fp32 output; all statistics are fp32.
FP8 (fp8=True, GPUs of compute capability >= 8.9): the logits GEMMs take E4M3 operands quantised once per
call with per-tensor scales; statistics, gradients and the gradient GEMMs keep their precision.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_spo import extras
from megatron_spo.ops.torch_kernels import TorchKernels

DEFAULT_CHUNK_SIZE = 4096  # tokens per block; the vocabulary tile then fills max_block_bytes
DEFAULT_MAX_BLOCK_BYTES = 64 * 2**20  # one fp32 logits block: 4096 tokens x 4096 vocabulary entries
# On a GPU a block spans up to 16384 tokens (every token of a typical micro-batch), so each vocabulary tile's
# weight gradient is ONE GEMM over all tokens (no accumulation pass) and each gradient GEMM has K >= 1024;
# 64 MiB is then 16384 x 1024, which keeps the op's memory at its gradients plus ~1/8 GiB at Llama-3's shape.
DEFAULT_CHUNK_SIZE_CUDA = 16384
DEFAULT_MAX_BLOCK_BYTES_CUDA = 64 * 2**20
# The default vocabulary tile is a multiple of this. The blocks' rows are vocab_tile long, and a row stride that is
# not a multiple of 8 bf16 elements (16 bytes) rules out cuBLAS's Hopper kernels: on an H200, 15360 kept tokens
# gave tiles of 1092 rows, whose GEMMs ran in a Turing-era kernel at ~155 TFLOP/s, half the 1B SPO step's time.
MIN_VOCAB_TILE = 128
FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper: first GPUs with FP8 tensor cores
_BACKENDS = ("auto", "torch", "triton")


class FP8UnavailableError(RuntimeError):
    """FP8 was asked for on a machine that cannot run FP8 GEMMs."""


@dataclass(frozen=True)
class _Plan:
    """Everything the autograd function needs besides tensors."""

    chunk_size: int
    vocab_tile: int
    vocab_start: int  # global vocabulary index of local row 0
    valid_local: int  # local rows [0, valid_local) are real tokens; the rest is padding
    tp_group: Any
    kernels: Any  # a class with update_stats(...), probs(...) and logits_grad(...)
    fp8: bool
    return_entropy: bool


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int | None = None,
    vocab_tile: int | None = None,
    return_entropy: bool = False,
    ignore_index: int = -100,
    vocab_start_index: int | None = None,
    valid_vocab_size: int | None = None,
    fp8: bool = False,
    backend: str = "auto",
    max_block_bytes: int | None = None,
    check_targets: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log p(targets | hidden) [N] fp32 (and entropy [N] fp32), gradients for hidden and weight.

    hidden [N, H]; weight [V_local, H], this rank's contiguous shard of the LM head; targets [N] global
    vocabulary ids or ``ignore_index``. vocab_start_index defaults to rank * V_local in ``tp_group``;
    valid_vocab_size (global, default tp_size * V_local) marks where vocabulary padding starts.
    chunk_size: tokens per block (default min(N, 4096) on CPU, min(N, 16384) on CUDA); vocab_tile: vocabulary
    rows per block (default: what keeps one fp32 block within max_block_bytes, at least 128). max_block_bytes
    defaults to 64 MiB. backend: "torch", "triton" (CUDA, or CPU under TRITON_INTERPRET=1) or
    "auto" (triton on CUDA when installed, else torch). fp8: run the logits GEMM (forward and its
    recompute) in FP8 E4M3 with per-tensor scales and fp32 output; the gradient GEMMs stay in the model
    dtype. Needs a GPU with FP8 tensor cores (compute capability >= 8.9).
    check_targets: verify target ids are in range (one host sync). Tokens whose target is ignore_index
    are dropped before any GEMM (one host sync to count them) and get log-prob 0, entropy 0, no gradient.
    """
    _check_shapes(hidden, weight, targets)
    n_tokens, v_local = hidden.shape[0], weight.shape[0]
    tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
    tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
    if vocab_start_index is None:
        vocab_start_index = tp_rank * v_local
    if valid_vocab_size is None:
        valid_vocab_size = tp_size * v_local
    if vocab_start_index < 0:
        raise ValueError(f"token_logprobs: vocab_start_index must be >= 0, got {vocab_start_index}")
    if not 0 < valid_vocab_size <= tp_size * v_local:
        raise ValueError(
            f"token_logprobs: valid_vocab_size={valid_vocab_size} must be in [1, {tp_size * v_local}] "
            f"(tp_size {tp_size} x V_local {v_local})"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"token_logprobs: chunk_size must be >= 1, got {chunk_size}")
    if vocab_tile is not None and vocab_tile < 1:
        raise ValueError(f"token_logprobs: vocab_tile must be >= 1, got {vocab_tile}")
    if max_block_bytes is None:
        max_block_bytes = DEFAULT_MAX_BLOCK_BYTES_CUDA if hidden.is_cuda else DEFAULT_MAX_BLOCK_BYTES
    if max_block_bytes < 4:
        raise ValueError(f"token_logprobs: max_block_bytes must be >= 4, got {max_block_bytes}")
    if fp8:
        _require_fp8(hidden)
    if check_targets and n_tokens:
        _check_target_range(targets, ignore_index, valid_vocab_size)

    kept = torch.nonzero(targets != ignore_index).squeeze(1)  # the same on every TP rank: global ids
    if 0 < kept.numel() < n_tokens:  # ignored tokens cost no GEMM work: run on the rest, scatter back
        out = token_logprobs(
            hidden.index_select(0, kept),
            weight,
            targets.index_select(0, kept),
            tp_group=tp_group,
            chunk_size=chunk_size,
            vocab_tile=vocab_tile,
            return_entropy=return_entropy,
            ignore_index=ignore_index,
            vocab_start_index=vocab_start_index,
            valid_vocab_size=valid_vocab_size,
            fp8=fp8,
            backend=backend,
            max_block_bytes=max_block_bytes,
            check_targets=False,
        )
        parts = out if return_entropy else (out,)
        full = tuple(part.new_zeros(n_tokens).index_copy(0, kept, part) for part in parts)
        return full if return_entropy else full[0]

    valid_local = max(0, min(v_local, valid_vocab_size - vocab_start_index))
    if chunk_size is None and hidden.is_cuda:
        chunk_size = DEFAULT_CHUNK_SIZE_CUDA
    chunk, vocab_tile = default_block_shape(n_tokens, valid_local, max_block_bytes, chunk_size, vocab_tile)
    plan = _Plan(
        chunk_size=chunk,
        vocab_tile=vocab_tile,
        vocab_start=vocab_start_index,
        valid_local=valid_local,
        tp_group=tp_group if tp_size > 1 else None,
        kernels=_select_kernels(backend, hidden),
        fp8=fp8,
        return_entropy=return_entropy,
    )
    logp, entropy = _TokenLogprobs.apply(hidden, weight, targets, ignore_index, plan)
    return (logp, entropy) if return_entropy else logp


def default_block_shape(
    n_tokens: int,
    v_local: int,
    max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
    chunk_size: int | None = None,
    vocab_tile: int | None = None,
) -> tuple[int, int]:
    """(chunk_size, vocab_tile) of the blocks token_logprobs walks; given values are only clipped to the problem."""
    chunk = max(1, min(chunk_size or DEFAULT_CHUNK_SIZE, n_tokens))
    if vocab_tile is None:  # a multiple of 128: the blocks' row stride must suit Hopper's GEMM kernels (below)
        vocab_tile = max(MIN_VOCAB_TILE, max_block_bytes // (4 * chunk) // MIN_VOCAB_TILE * MIN_VOCAB_TILE)
    return chunk, max(1, min(vocab_tile, v_local))


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------
class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index, plan):
        ignored = targets == ignore_index
        target_col = _local_target_columns(targets, ignored, plan)
        m, s, t, target_logit = _local_statistics(hidden, weight, target_col, plan)
        lse, mean_logit, target_logit = _combine_across_ranks(m, s, t, target_logit, plan.tp_group)
        logp = (target_logit - lse).masked_fill_(ignored, 0.0)
        entropy = (lse - mean_logit).masked_fill_(ignored, 0.0) if plan.return_entropy else None
        ctx.save_for_backward(
            hidden, weight, target_col, ignored, lse, mean_logit if plan.return_entropy else lse
        )
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no work for it
        if entropy is None:
            entropy = torch.zeros_like(logp)  # a placeholder output, dropped by token_logprobs
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, target_col, ignored, lse, mean_logit = ctx.saved_tensors
        plan: _Plan = ctx.plan
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_hidden or need_weight):
            return None, None, None, None, None
        zero = torch.zeros((), device=lse.device)
        grad_logp = torch.where(ignored, zero, _as_fp32(grad_logp, lse))
        if grad_entropy is not None:  # None (grads are not materialised): the entropy was not used
            grad_entropy = torch.where(ignored, zero, grad_entropy.float())
        grad_hidden, grad_weight = _recompute_gradients(
            hidden,
            weight,
            target_col,
            lse,
            mean_logit,
            grad_logp,
            grad_entropy,
            plan,
            need_hidden,
            need_weight,
        )
        return grad_hidden, grad_weight, None, None, None


def _as_fp32(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.float()


# ---------------------------------------------------------------------------------------------
# Blocks of logits
# ---------------------------------------------------------------------------------------------
def _blocks(plan: _Plan, n_tokens: int):
    """(v0, v1, c0, c1) for every block: vocabulary tiles outer, token chunks inner."""
    for v0 in range(0, plan.valid_local, plan.vocab_tile):
        v1 = min(v0 + plan.vocab_tile, plan.valid_local)
        for c0 in range(0, n_tokens, plan.chunk_size):
            yield v0, v1, c0, min(c0 + plan.chunk_size, n_tokens)


class _LogitsBlocks:
    """The logits blocks hidden[c0:c1] @ weight[v0:v1]^T as contiguous fp32 [C, Vt] views of one reused buffer.

    Operands are prepared once, not once per block: blocks walk vocabulary tiles outer and token chunks
    inner, so a tile's operand (upcast to fp32 for a bf16 model on CPU, which has no mixed-precision GEMM;
    quantised to E4M3 under FP8) is made when the walk reaches it and kept for all its chunks.
    FP8 uses one per-tensor scale for hidden and one for the weight shard (amax / 448, the current-scaling
    recipe of Transformer Engine), computed from the same tensors in the forward and the backward, so the
    recomputed blocks equal the forward's bit for bit and p = exp(z - lse) stays normalised.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, plan: _Plan):
        n_tokens = hidden.shape[0]
        size = min(plan.chunk_size, n_tokens) * min(plan.vocab_tile, max(plan.valid_local, 1))
        self.buffer = torch.empty(size, dtype=torch.float32, device=hidden.device)  # no allocation per block
        self.weight, self.fp8 = weight, plan.fp8
        self._tile_start, self.tile = -1, None  # the current tile's operand, as the logits GEMM takes it
        if plan.fp8:
            self.hidden_scale = _fp8_scale(hidden)
            self.hidden = _quantise_fp8(hidden, self.hidden_scale)
            self.weight_scale = _fp8_scale(weight[: plan.valid_local])
        else:
            self.hidden = hidden if _mixed_precision_gemm(hidden) else hidden.float()  # no-op for fp32

    def __call__(self, v0: int, v1: int, c0: int, c1: int) -> torch.Tensor:
        rows, cols = c1 - c0, v1 - v0
        out = self.buffer[: rows * cols].view(rows, cols)
        if v0 != self._tile_start:
            self._tile_start, self.tile = v0, self._prepare_tile(self.weight[v0:v1])
        if self.fp8:
            _fp8_matmul(self.hidden[c0:c1], self.tile, self.hidden_scale, self.weight_scale, out)
        else:
            _logits_block(self.hidden[c0:c1], self.tile, out)
        return out

    def _prepare_tile(self, tile: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            return _quantise_fp8(tile, self.weight_scale, row_multiple=16)
        return tile if _mixed_precision_gemm(tile) else tile.float()


_HAS_MM_OUT_DTYPE = hasattr(torch.ops.aten.mm, "dtype")  # torch >= 2.8: aten::mm.dtype (bf16 in, fp32 out)


def _mixed_precision_gemm(x: torch.Tensor) -> bool:
    """Whether GEMMs on x run in its bf16/fp16 dtype with fp32 accumulation and fp32 output.

    True on CUDA with torch >= 2.8. Elsewhere (CPU: no such kernel; CUDA under an older torch) a
    low-precision operand is upcast to fp32, once per tensor or tile, and the GEMMs run in fp32.
    """
    return x.is_cuda and x.dtype != torch.float32 and _HAS_MM_OUT_DTYPE


def _logits_block(hidden_chunk: torch.Tensor, weight_tile: torch.Tensor, out: torch.Tensor) -> None:
    """out [C, Vt] fp32 = hidden_chunk [C, H] @ weight_tile [Vt, H]^T (fp32 output from bf16/fp16 on CUDA)."""
    if hidden_chunk.dtype == torch.float32:
        torch.mm(hidden_chunk, weight_tile.t(), out=out)
    else:  # cuBLAS accumulates in fp32 and writes fp32 straight into the block
        torch.mm(hidden_chunk, weight_tile.t(), out_dtype=torch.float32, out=out)


_ADDMM_INTO_FP32: dict[torch.device, bool] = {}  # device -> whether addmm(out, bf16, bf16, fp32 out=out) works


def _addmm_into_fp32_works(device: torch.device) -> bool:
    """Whether this torch accumulates a bf16 product into an fp32 tensor in place (aten::addmm.dtype_out, beta = 1,
    out aliasing its input) on the device: probed once per device on a 16 x 16 product against mm + add."""
    if device not in _ADDMM_INTO_FP32:
        ok = hasattr(torch.ops.aten.addmm, "dtype_out")
        if ok:
            gen = torch.Generator(device=device).manual_seed(0)
            a, b = (torch.randn(16, 16, generator=gen, device=device).to(torch.bfloat16) for _ in range(2))
            acc = torch.randn(16, 16, generator=gen, device=device)
            want = acc + torch.mm(a.float(), b.float())
            try:
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                ok = bool(torch.allclose(acc, want, rtol=1e-5, atol=1e-5))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _ADDMM_INTO_FP32[device] = ok
    return _ADDMM_INTO_FP32[device]


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (fp32) = a @ b, or += when accumulate; a is p or a logits gradient, b in the model dtype.

    The first write overwrites (beta = 0), so an output never needs zero-filling beforehand; an accumulating
    write is one GEMM with beta = 1 into out (no product-sized temporary). On CUDA with a bf16/fp16 b, a is
    multiplied in b's dtype with fp32 accumulation and output, as in megatron.
    """
    if not _mixed_precision_gemm(b):  # fp32 GEMM (b.float() is a no-op for an fp32 b, such as a tile
        if accumulate:  # already upcast once)
            out.addmm_(a, b.float())
        else:
            torch.mm(a, b.float(), out=out)
        return
    a = a.to(b.dtype)  # a no-op when the kernel wrote the block in b's dtype
    if not accumulate:
        torch.mm(a, b, out_dtype=torch.float32, out=out)
    elif _addmm_into_fp32_works(out.device):
        torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
    else:  # a torch without it: a product-sized temporary and an add pass
        out.add_(torch.mm(a, b, out_dtype=torch.float32))


def narrow_in_place(x: torch.Tensor, dtype: torch.dtype, slab_elements: int = 2**22) -> torch.Tensor:
    """x (contiguous fp32) converted to the 2-byte ``dtype`` inside x's own storage: no second full-size tensor.

    Slabs go front to back: slab [i, i + k)'s narrow copy lands in bytes [2i, 2i + 2k), which only slabs
    already read (or this one, read into its small temporary first) occupied. The result views x's storage
    (its first half), so that storage lives as long as the result does.
    """
    if x.dtype == dtype:
        return x
    if x.dtype != torch.float32 or torch.empty((), dtype=dtype).element_size() != 2 or not x.is_contiguous():
        return x.to(dtype)
    flat = x.view(-1)
    out = flat.view(dtype)[: flat.numel()]  # fp32 [n] viewed as [2n] of the narrow dtype: its first n
    for i in range(0, flat.numel(), slab_elements):
        slab = flat[i : i + slab_elements].to(dtype)  # read before its bytes can be overwritten
        out[i : i + slab.numel()].copy_(slab)
    return out.view(x.shape)


def _local_target_columns(targets: torch.Tensor, ignored: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """[N] int64: the target's local row on this rank, or -1 when another rank owns it (or it is ignored)."""
    col = targets.long() - plan.vocab_start
    owned = (col >= 0) & (col < plan.valid_local) & ~ignored
    return torch.where(owned, col, torch.full_like(col, -1))


def _block_target_columns(target_col: torch.Tensor, v0: int, v1: int) -> torch.Tensor:
    col = target_col - v0
    return torch.where((target_col >= 0) & (col < v1 - v0), col, torch.full_like(col, -1))


def _local_statistics(hidden, weight, target_col, plan: _Plan):
    """Per-token online-softmax statistics over this rank's valid vocabulary: m, s, t (or None), target logit."""
    n_tokens, device = hidden.shape[0], hidden.device
    m = torch.full((n_tokens,), float("-inf"), dtype=torch.float32, device=device)
    s = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    t = torch.zeros(n_tokens, dtype=torch.float32, device=device) if plan.return_entropy else None
    target_logit = torch.zeros(n_tokens, dtype=torch.float32, device=device)
    if n_tokens == 0 or plan.valid_local == 0:
        return m, s, t, target_logit
    logits = _LogitsBlocks(hidden, weight, plan)
    for v0, v1, c0, c1 in _blocks(plan, n_tokens):
        z = logits(v0, v1, c0, c1)
        plan.kernels.update_stats(
            z,
            _block_target_columns(target_col[c0:c1], v0, v1),
            m[c0:c1],
            s[c0:c1],
            None if t is None else t[c0:c1],
            target_logit[c0:c1],
        )
    return m, s, t, target_logit


def _combine_across_ranks(m, s, t, target_logit, tp_group):
    """Global logsumexp [N], E_p[z] [N] (or None) and target logit [N] from every rank's local statistics."""
    if tp_group is not None:
        global_max = m.clone()
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
        scale = torch.exp(m - global_max)  # a rank with no valid vocabulary has m = -inf: scale 0
        parts = [s * scale, target_logit] + ([t * scale] if t is not None else [])
        packed = torch.stack(parts)
        dist.all_reduce(packed, group=tp_group)
        s, target_logit = packed[0], packed[1]
        t = packed[2] if t is not None else None
        m = global_max
    lse = m + torch.log(s)
    mean_logit = t / s if t is not None else None
    return lse, mean_logit, target_logit


def _recompute_gradients(
    hidden, weight, target_col, lse, mean_logit, grad_logp, grad_entropy, plan, need_hidden, need_weight
):
    """grad_hidden [N, H] (all-reduced over TP) and grad_weight [V_local, H], block by block.

    On a GPU each block becomes dL/dz = g * (onehot - p) + g_H * p * (E_p[z] - z) in one kernel pass, written
    in the model dtype when the GEMMs take it so (the gradient GEMMs' operand; no conversion pass).
    On CPU, without an entropy gradient, dL/dz factors per token, so the blocks only hold p = exp(z - lse): the
    -g goes into the GEMM operands (hidden rows scaled once, grad_hidden rows scaled once at the end) and the
    onehot term is one gather/scatter of N rows instead of a pass per block (CPU passes over a block are slow).
    grad_hidden accumulates over vocabulary tiles in fp32 and is narrowed to the model dtype in place.
    """
    n_tokens, device = hidden.shape[0], hidden.device
    if not (n_tokens and plan.valid_local):  # nothing to multiply: this rank's gradients are 0
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=device) if need_hidden else None
        if need_hidden and plan.tp_group is not None:
            dist.all_reduce(grad_hidden, group=plan.tp_group)
        grad_weight = torch.zeros_like(weight) if need_weight else None
        return (grad_hidden.to(hidden.dtype) if need_hidden else None), grad_weight
    # Every element of both gradients is first written by a GEMM with beta = 0 (no zero-fill pass).
    grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=device) if need_hidden else None
    grad_weight = torch.empty_like(weight) if need_weight else None
    if need_weight:
        grad_weight[plan.valid_local :].zero_()  # vocabulary padding gets no gradient
    factored = _factored_backward(hidden, grad_entropy)
    weight_acc = None
    if need_weight and weight.dtype != torch.float32:
        weight_acc = torch.empty(
            min(plan.vocab_tile, plan.valid_local), weight.shape[1], dtype=torch.float32, device=device
        )
    scaled_hidden = hidden
    if factored and need_weight:  # -g * hidden: the GEMM operand of grad_weight's p^T term
        operand_dtype = hidden.dtype if _mixed_precision_gemm(hidden) else torch.float32
        scaled_hidden = (hidden.float() * -grad_logp[:, None]).to(operand_dtype)
    logits = _LogitsBlocks(hidden, weight, plan)
    # cuBLAS multiplies the block in the model dtype (one kernel writes it so); CPU GEMMs run in fp32
    low_precision_operand = _mixed_precision_gemm(weight)
    narrow = torch.empty_like(logits.buffer, dtype=weight.dtype) if low_precision_operand else None
    for v0, v1, c0, c1 in _blocks(plan, n_tokens):
        dz = logits(v0, v1, c0, c1)
        # the tile as the gradient GEMMs take it (fp32 on CPU, prepared once per tile; not the FP8 copy)
        weight_tile = weight[v0:v1] if plan.fp8 else logits.tile
        operand = dz if narrow is None else narrow[: dz.numel()].view(dz.shape)
        if factored:
            plan.kernels.probs(dz, lse[c0:c1])  # p; the caller's -g is applied outside (CPU only: fp32 blocks)
        else:
            plan.kernels.logits_grad(
                dz,
                _block_target_columns(target_col[c0:c1], v0, v1),
                lse[c0:c1],
                grad_logp[c0:c1],
                grad_entropy[c0:c1] if grad_entropy is not None else None,
                mean_logit[c0:c1] if grad_entropy is not None else None,
                out=operand,
            )
        if need_hidden:
            _matmul_into(grad_hidden[c0:c1], operand, weight_tile, accumulate=v0 > 0)
        if need_weight:
            acc = grad_weight[v0:v1] if weight_acc is None else weight_acc[: v1 - v0]
            _matmul_into(acc, operand.t(), scaled_hidden[c0:c1], accumulate=c0 > 0)
            if c1 == n_tokens:  # the tile is complete
                if factored:
                    _add_target_rows_to_weight_grad(acc, hidden, target_col, grad_logp, v0, v1)
                if weight_acc is not None:
                    grad_weight[v0:v1].copy_(acc)
    del logits, operand, scaled_hidden, narrow, weight_acc  # the N x H temporaries below must not add to the peak
    if need_hidden and factored:
        grad_hidden.mul_(-grad_logp[:, None])
        owned = torch.nonzero(target_col >= 0).squeeze(1)
        target_rows = weight.index_select(0, target_col[owned]).float()
        grad_hidden.index_add_(0, owned, target_rows.mul_(grad_logp[owned, None]))
    if need_hidden and plan.tp_group is not None:
        dist.all_reduce(grad_hidden, group=plan.tp_group)  # each rank saw only its vocabulary shard
    if need_hidden:
        grad_hidden = narrow_in_place(grad_hidden, hidden.dtype)
    return grad_hidden, grad_weight


def _factored_backward(hidden: torch.Tensor, grad_entropy: torch.Tensor | None) -> bool:
    """Whether the backward keeps p in its blocks and applies -g and the onehot term per token (CPU, no
    entropy gradient), rather than one kernel pass forming dL/dz per block (GPU; any entropy gradient)."""
    return grad_entropy is None and not hidden.is_cuda


def _add_target_rows_to_weight_grad(acc, hidden, target_col, grad_logp, v0: int, v1: int) -> None:
    """acc [v1 - v0, H] fp32 += the onehot term g * hidden of the tokens whose target is in this tile."""
    tokens = torch.nonzero((target_col >= v0) & (target_col < v1)).squeeze(1)
    rows = hidden.index_select(0, tokens).float().mul_(grad_logp[tokens, None])
    acc.index_add_(0, target_col[tokens] - v0, rows.to(acc.dtype))


# ---------------------------------------------------------------------------------------------
# Input checks, backend and FP8 selection
# ---------------------------------------------------------------------------------------------
def _check_shapes(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2:
        raise ValueError(f"token_logprobs: hidden must be [N, H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"token_logprobs: weight must be [V_local, H] with H={hidden.shape[1]} (hidden's), got shape {tuple(weight.shape)}"
        )
    if targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"token_logprobs: targets must be [N] with N={hidden.shape[0]}, got shape {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"token_logprobs: targets must be integer token ids, got dtype {targets.dtype}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            f"token_logprobs: hidden and weight must share one of float32/bfloat16/float16, got {hidden.dtype} and {weight.dtype}"
        )
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"token_logprobs: hidden, weight and targets must be on one device, got {hidden.device}, {weight.device}, {targets.device}"
        )


def _check_target_range(targets: torch.Tensor, ignore_index: int, valid_vocab_size: int) -> None:
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= valid_vocab_size))
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(
            f"token_logprobs: targets[{i}]={int(targets[i])} is outside the vocabulary [0, {valid_vocab_size}) "
            f"and is not ignore_index={ignore_index}"
        )


def _select_kernels(backend: str, hidden: torch.Tensor):
    if backend not in _BACKENDS:
        raise ValueError(f"token_logprobs: backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "torch" or (backend == "auto" and not (hidden.is_cuda and extras.triton() is not None)):
        return TorchKernels
    if extras.triton() is None:
        raise ValueError("token_logprobs: backend='triton' but triton is not installed")
    if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "token_logprobs: backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported"
        )
    from megatron_spo.ops import triton_logprobs

    return triton_logprobs.TritonKernels


def fp8_available(device: torch.device | None = None) -> bool:
    """True where FP8 GEMMs can run: a CUDA GPU with compute capability >= 8.9 (Ada, Hopper and later).

    The LM-head GEMM uses torch._scaled_mm (cuBLASLt) directly, with Transformer Engine's per-tensor
    current-scaling recipe: Transformer Engine itself is not needed for it.
    """
    if not (extras.cuda_available() and hasattr(torch, "_scaled_mm")):
        return False
    return torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY


def _require_fp8(hidden: torch.Tensor) -> None:
    if not hidden.is_cuda or not fp8_available(hidden.device):
        where = "CPU tensors" if not hidden.is_cuda else f"device {hidden.device}"
        raise FP8UnavailableError(
            "token_logprobs(fp8=True): FP8 needs a GPU with FP8 tensor cores "
            f"(compute capability >= 8.9); not available here ({where})"
        )
    if hidden.shape[1] % 16:
        raise ValueError(f"token_logprobs(fp8=True): hidden size {hidden.shape[1]} must be a multiple of 16")


FP8_MAX = 448.0  # largest finite float8_e4m3fn
_QUANTISE_SLAB_BYTES = 64 * 2**20  # fp32 scratch of one quantisation step


def _fp8_scale(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor dequantisation scale amax(|x|) / 448 as an fp32 0-d tensor on x's device (never 0)."""
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return (amax / FP8_MAX).clamp(min=1e-12)


def _quantise_fp8(x: torch.Tensor, scale: torch.Tensor, row_multiple: int = 1) -> torch.Tensor:
    """x [R, K] / scale rounded to E4M3, [ceil(R / row_multiple) * row_multiple, K] with zero rows appended.

    Done in slabs of rows so the fp32 scratch stays within 64 MiB whatever the size of x.
    """
    rows, k = x.shape
    padded = -(-rows // row_multiple) * row_multiple
    out = torch.empty(padded, k, dtype=torch.float8_e4m3fn, device=x.device)
    out[rows:].zero_()
    slab = max(1, _QUANTISE_SLAB_BYTES // (4 * max(k, 1)))
    for r0 in range(0, rows, slab):
        r1 = min(r0 + slab, rows)
        out[r0:r1].copy_(torch.div(x[r0:r1].float(), scale).clamp_(-FP8_MAX, FP8_MAX))  # x is not modified
    return out


def _fp8_matmul(
    a_q: torch.Tensor, b_q: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, out: torch.Tensor
) -> None:
    """out [M, N] fp32 = dequantised a_q [M, K] @ b_q [N', K]^T, N' >= N (rows past N are padding).

    torch._scaled_mm needs K and N' to be multiples of 16 (_quantise_fp8 pads the weight tile's rows).
    """
    cols = out.shape[1]
    if b_q.shape[0] == cols:  # no padding: the GEMM writes the block in place
        torch._scaled_mm(a_q, b_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32, out=out)
    else:
        full = torch._scaled_mm(a_q, b_q.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
        out.copy_(full[:, :cols])
