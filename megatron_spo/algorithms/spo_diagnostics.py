"""What shows SPO drifting before it diverges (MATH.md section 7): per-batch statistics, no gradient.

The signed residual d = Q_T - r is the quantity to watch: its mean over a sampler's responses drives the policy
away from that sampler (with d_bar > 0) and grows with KL(pi || pi*), so it rises long before the log-ratio runs
away. Shapes: logp, ref_logp, mask, behaviour_logp [B, T]; reward, q0, group [B]. Every value is a mean over
sequences returned with how many it averages, so micro-batch means combine exactly when weighted by that count
(residual_group_var, given `group`: exact when prompt groups are never split across micro-batches).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_spo.algorithms.groups import group_mean
from megatron_spo.algorithms.spo import cumulative_q
from megatron_spo.algorithms.validation import upcast

POSITION_BINS = 4  # log-ratio by quarter of each response


def residuals(logp: Tensor, ref_logp: Tensor, mask: Tensor, reward: Tensor, q0: Tensor, beta: float) -> Tensor:
    """d = Q_T - r per sequence, [B] (detached)."""
    valid = mask if mask.dtype == torch.bool else mask != 0
    logp = upcast(logp.detach())
    q = cumulative_q(logp, upcast(ref_logp), valid, q0.to(logp.dtype), beta)
    return q[:, -1] - reward.to(q.dtype)


@torch.no_grad()
def spo_diagnostics(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    reward: Tensor,
    q0: Tensor,
    *,
    beta: float,
    group: Tensor | None = None,
    behaviour_logp: Tensor | None = None,
) -> dict[str, tuple[float, int]]:
    """Drift statistics of one source's sequences, each (mean over sequences, number of sequences averaged):

    residual_mean      signed mean of d = Q_T - r (> 0 pushes pi away from its sampler)
    residual_sq        mean of d^2 (spread: sqrt(residual_sq - residual_mean^2))
    residual_group_var mean squared deviation of d from its prompt group's mean (what a centred loss keeps;
                       only when `group` is given)
    response_length    mean response tokens
    log_ratio_pos{k}   mean per-token log(pi / pi_0) in the k-th quarter of each response (k = 1..4)
    q_pos{k}           mean Q_t at the last token of the k-th quarter (q_pos4 = Q_T): where along a response
                       the policy's soft value moves, e.g. on expert text against its own samples
    kl_sampler_k1/k3   KL(mu || pi) per sequence from behaviour log-probs log mu (rows that have them): the k1
                       estimate sum_t (log mu - log pi) and the non-negative k3 sum_t (rho - 1 - log rho),
                       rho = pi / mu, over the rows that have them (absent if none)
    """
    valid = mask if mask.dtype == torch.bool else mask != 0
    logp, ref_logp = upcast(logp.detach()), upcast(ref_logp)
    q = cumulative_q(logp, ref_logp, valid, q0.to(logp.dtype), beta)
    d = q[:, -1] - reward.to(q.dtype)  # = residuals(...)
    lengths = valid.sum(1).to(d.dtype)
    b = d.shape[0]
    out = {
        "residual_mean": (d.mean(), b),
        "residual_sq": ((d**2).mean(), b),
        "response_length": (lengths.mean(), b),
    }
    if group is not None:
        out["residual_group_var"] = (((d - group_mean(d, group.to(d.device))) ** 2).mean(), b)
    zero = torch.zeros((), dtype=d.dtype, device=d.device)
    token_ratio = torch.where(valid, logp - ref_logp, zero)
    rank = (valid.cumsum(1) - 1).to(d.dtype)  # 0-based index of each response token inside its response
    bin_of = torch.floor(rank * POSITION_BINS / lengths.clamp(min=1).unsqueeze(1)).clamp(max=POSITION_BINS - 1)
    for k in range(POSITION_BINS):
        in_bin = valid & (bin_of == k)
        count = in_bin.sum(1)
        per_seq = torch.where(in_bin, token_ratio, zero).sum(1) / count.clamp(min=1)
        has = count > 0
        rows_in_bin = int(has.sum())
        if rows_in_bin:
            out[f"log_ratio_pos{k + 1}"] = (per_seq[has].mean(), rows_in_bin)
            last = torch.where(in_bin, torch.arange(valid.shape[1], device=valid.device), -1).amax(1)
            out[f"q_pos{k + 1}"] = (q.gather(1, last.clamp(min=0).unsqueeze(1)).squeeze(1)[has].mean(), rows_in_bin)
    if behaviour_logp is not None:
        behaviour_logp = upcast(behaviour_logp)
        rows = (torch.where(valid, behaviour_logp, zero) != 0).any(1)
        n_rows = int(rows.sum())
        if n_rows:
            log_rho = torch.where(valid, logp - behaviour_logp, zero)[rows]
            out["kl_sampler_k1"] = ((-log_rho).sum(1).mean(), n_rows)
            out["kl_sampler_k3"] = ((log_rho.exp() - 1 - log_rho).sum(1).mean(), n_rows)
    return {k: (float(v), n) for k, (v, n) in out.items()}
