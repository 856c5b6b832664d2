"""Triton kernels for one block of logits: online-softmax statistics and the logits gradient.

Drop-in for ``torch_kernels.TorchKernels`` (same three functions, same in-place contract); the GEMMs
stay with cuBLAS (or FP8 _scaled_mm). One program handles one token row and walks the block's vocabulary
columns in BLOCK_V-wide tiles with an online max/sum, so a row of any width needs no more registers.

Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (set before triton is first imported), which
is how the tests check it against the torch backend. Lanes past the end of a row load -inf; every
quantity that could become -inf - -inf (NaN) or 0 * -inf is guarded.
"""

from __future__ import annotations

import torch

from megatron_spo import extras

triton = extras.triton()
if triton is None:  # pragma: no cover - triton is a test/GPU extra
    raise ImportError("megatron_spo.ops.triton_logprobs needs triton (pip install triton)")
import triton.language as tl  # noqa: E402

MAX_BLOCK_V = 2048


@triton.jit
def _stats_kernel(
    z_ptr, stride_z, col_ptr, m_ptr, s_ptr, t_ptr, tgt_ptr, n_cols,
    HAS_T: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    col = tl.load(col_ptr + row)
    m = tl.load(m_ptr + row)
    s = tl.load(s_ptr + row)
    t = tl.load(t_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        lane = offs < n_cols
        z = tl.load(z_row + offs, mask=lane, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all lanes so far masked: no NaN
        alpha = tl.exp(m - m_safe)
        e = tl.where(lane, tl.exp(z - m_safe), 0.0)
        s = s * alpha + tl.sum(e, axis=0)
        if HAS_T:
            z_finite = tl.where(lane, z, 0.0)  # masked lanes would give 0 * -inf = NaN
            t = t * alpha + tl.sum(e * z_finite, axis=0)
        tgt += tl.sum(tl.where(lane & (offs == col), z, 0.0), axis=0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    if HAS_T:
        tl.store(t_ptr + row, t)
    tl.store(tgt_ptr + row, tgt)


@triton.jit
def _grad_kernel(
    z_ptr, stride_z, out_ptr, stride_out, col_ptr, lse_ptr, g_ptr, ge_ptr, ez_ptr, n_cols,
    HAS_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    z_row = z_ptr + row.to(tl.int64) * stride_z
    out_row = out_ptr + row.to(tl.int64) * stride_out
    col = tl.load(col_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.load(g_ptr + row)
    ge = tl.load(ge_ptr + row)
    ez = tl.load(ez_ptr + row)
    for start in range(0, n_cols, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        lane = offs < n_cols
        z = tl.load(z_row + offs, mask=lane, other=0.0)
        p = tl.exp(z - lse)
        coef = -g
        if HAS_ENTROPY:
            coef = coef + ge * (ez - z)
        dz = p * coef + tl.where(offs == col, g, 0.0)
        tl.store(out_row + offs, dz.to(out_ptr.dtype.element_ty), mask=lane)  # z itself, or a bf16 operand


def _block_v(n_cols: int, block_v: int | None) -> int:
    return block_v or min(MAX_BLOCK_V, triton.next_power_of_2(max(n_cols, 1)))


class TritonKernels:
    """Same contract as TorchKernels: z is a contiguous fp32 [C, Vt] block, per-row vectors are [C] fp32."""

    @staticmethod
    def update_stats(z, col, m, s, t, target_logit, *, block_v: int | None = None) -> None:
        rows, n_cols = z.shape
        if rows == 0:
            return
        _stats_kernel[(rows,)](
            z, z.stride(0), col.contiguous(), m, s, s if t is None else t, target_logit, n_cols,
            HAS_T=t is not None, BLOCK_V=_block_v(n_cols, block_v),
        )  # fmt: skip

    @staticmethod
    def probs(z, lse, *, block_v: int | None = None) -> None:
        """z [C, Vt] -> exp(z - lse): the gradient kernel with g = -1 and no target column."""
        rows = z.shape[0]
        minus_one = torch.full((rows,), -1.0, dtype=torch.float32, device=z.device)
        no_target = torch.full((rows,), -1, dtype=torch.int64, device=z.device)
        TritonKernels.logits_grad(z, no_target, lse, minus_one, None, None, block_v=block_v)

    @staticmethod
    def logits_grad(
        z, col, lse, grad_logp, grad_entropy, mean_logit, out=None, *, block_v: int | None = None
    ) -> None:
        """dL/dz into out ([C, Vt] with unit column stride, e.g. the model dtype's GEMM operand) or into z."""
        rows, n_cols = z.shape
        if rows == 0:
            return
        has_entropy = grad_entropy is not None
        out = z if out is None else out
        if out.shape != z.shape or out.stride(1) != 1:
            raise ValueError(f"logits_grad: out must be {tuple(z.shape)} with unit column stride")
        _grad_kernel[(rows,)](
            z, z.stride(0), out, out.stride(0), col.contiguous(), lse.contiguous(), grad_logp.contiguous(),
            grad_entropy.contiguous() if has_entropy else grad_logp,
            mean_logit.contiguous() if has_entropy else grad_logp,
            n_cols, HAS_ENTROPY=has_entropy, BLOCK_V=_block_v(n_cols, block_v),
        )  # fmt: skip


def reference_block_check(
    rows: int = 5, cols: int = 37, block_v: int = 16, seed: int = 0
) -> dict[str, float]:
    """Max |difference| Triton vs torch on one random block (statistics and gradient); for tests."""
    from megatron_spo.ops.torch_kernels import TorchKernels

    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, cols, generator=gen) * 3
    col = torch.randint(-1, cols, (rows,), generator=gen)
    # running statistics as after an earlier block; row 0 has seen nothing yet (m = -inf, s = t = 0)
    m0 = torch.full((rows,), 0.5)
    m0[0] = float("-inf")
    s0 = torch.rand(rows, generator=gen) + 1
    s0[0] = 0.0
    t0 = torch.randn(rows, generator=gen) * s0
    g, ge = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    out = {}
    results = []
    for kernels, kw in ((TorchKernels, {}), (TritonKernels, {"block_v": block_v})):
        m, s, t, tgt = m0.clone(), s0.clone(), t0.clone(), torch.zeros(rows)
        kernels.update_stats(z.clone(), col, m, s, t, tgt, **kw)
        lse, ez = m + torch.log(s), t / s
        dz, p = z.clone(), z.clone()
        kernels.logits_grad(dz, col, lse, g, ge, ez, **kw)
        kernels.probs(p, lse, **kw)
        # the same gradient written into a bf16 operand (what the GPU's gradient GEMMs take) must be dz rounded
        dz_bf16 = torch.empty(rows, cols, dtype=torch.bfloat16)
        kernels.logits_grad(z.clone(), col, lse, g, None, None, out=dz_bf16, **kw)
        results.append((m, s, t, tgt, dz, p, dz_bf16.float()))
    for name, a, b in zip(("m", "s", "t", "target_logit", "dz", "p", "dz_bf16_no_entropy"), *results):
        out[name] = float((a - b).abs().max())
    return out
