"""The per-block math of token_logprobs in torch (the CPU backend, and the reference the Triton kernels of
triton_logprobs.py are held to): three in-place functions over one fp32 logits block z [C, Vt].

    TorchKernels.update_stats(z, col, m, s, t, target_logit)   # online logsumexp / entropy statistics
    TorchKernels.probs(z, lse)                                 # z <- softmax block
    TorchKernels.logits_grad(z, col, lse, g, g_H, E_z)         # z <- dL/dz
"""

from __future__ import annotations

import torch


class TorchKernels:
    """Per-block statistics and logits gradient in torch; z is a contiguous fp32 [C, Vt] block.

    exp(x) is computed as exp2(x * log2(e)): torch's CPU exp2 is ~2.5x faster than its exp, and the scaling
    rides on the subtraction pass that is needed anyway (torch.add(-shift * log2e, z, alpha=log2e)).
    """

    @staticmethod
    def update_stats(z, col, m, s, t, target_logit) -> None:
        """Fold block z into the running m, s, t (None: no entropy) and target_logit, all [C], in place.

        col [C]: the target's column in this block, or -1. z is overwritten.
        """
        owned = col >= 0
        picked = z.gather(1, col.clamp(min=0)[:, None]).squeeze(1)
        target_logit.add_(torch.where(owned, picked, torch.zeros_like(picked)))
        m_new = torch.maximum(m, z.amax(dim=1))  # finite: a block has at least one column
        alpha = torch.exp(m - m_new)
        if t is None:
            s_block = _exp_shifted(z, m_new).sum(dim=1)
        else:
            shifted = _scaled_shift(z, m_new)  # (z - m_new) * log2(e), in place
            s_block, t_block = torch.empty_like(m), torch.empty_like(m)
            for r0, r1, e in _row_slabs(shifted):  # e = exp2(shifted) a slab at a time, in a reused scratch
                torch.exp2(shifted[r0:r1], out=e)
                torch.sum(e, dim=1, out=s_block[r0:r1])
                torch.bmm(e[:, None, :], shifted[r0:r1, :, None], out=t_block[r0:r1].view(-1, 1, 1))
            # sum e * z = ln2 * sum e * shifted + m_new * s
            t.mul_(alpha).add_(t_block.mul_(LN2).add_(m_new * s_block))
        s.mul_(alpha).add_(s_block)
        m.copy_(m_new)

    @staticmethod
    def probs(z, lse) -> None:
        """Overwrite z [C, Vt] with p = exp(z - lse), lse [C]."""
        _exp_shifted(z, lse)

    @staticmethod
    def logits_grad(z, col, lse, grad_logp, grad_entropy, mean_logit, out=None) -> None:
        """Overwrite z [C, Vt] with dL/dz = p * (-g + g_H * (E_p[z] - z)) + g * onehot(col); also into out
        ([C, Vt], any float dtype) when given and not z itself. grad_entropy / mean_logit None: no entropy term."""
        if grad_entropy is None:
            _exp_shifted(z, lse).mul_(-grad_logp[:, None])
        else:
            for r0, r1, p in _row_slabs(z):  # p a slab at a time, in a reused scratch
                z_rows = z[r0:r1]
                torch.sub(z_rows, lse[r0:r1, None], out=p).exp_()
                z_rows.neg_().add_(mean_logit[r0:r1, None]).mul_(grad_entropy[r0:r1, None])
                z_rows.sub_(grad_logp[r0:r1, None]).mul_(p)
        owned = col >= 0
        rows = torch.nonzero(owned).squeeze(1)
        z[rows, col[rows]] += grad_logp[rows]
        if out is not None and out.data_ptr() != z.data_ptr():
            out.copy_(z)


_SLAB_BYTES = 4 * 2**20  # scratch for the entropy terms: cache-sized, and no [C, Vt] allocation per block


def _row_slabs(z: torch.Tensor):
    """(r0, r1, scratch [r1 - r0, Vt]) over the rows of z [C, Vt], reusing one small fp32 scratch."""
    rows = max(1, min(z.shape[0], _SLAB_BYTES // (4 * max(z.shape[1], 1))))
    scratch = torch.empty(rows, z.shape[1], dtype=torch.float32, device=z.device)
    for r0 in range(0, z.shape[0], rows):
        r1 = min(r0 + rows, z.shape[0])
        yield r0, r1, scratch[: r1 - r0]


LOG2E = 1.4426950408889634  # log2(e)
LN2 = 0.6931471805599453  # ln(2)


def _scaled_shift(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """z [C, Vt] <- (z - shift[:, None]) * log2(e) in place, in one pass."""
    return torch.add(shift[:, None] * -LOG2E, z, alpha=LOG2E, out=z)


def _exp_shifted(z: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """z [C, Vt] <- exp(z - shift[:, None]) in place, in two passes (a scaled subtraction, then exp2)."""
    return _scaled_shift(z, shift).exp2_()
