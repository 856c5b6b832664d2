"""AGRO (any-generation reward optimisation) and the KL-regularised policy-gradient baseline.

MATH.md section 4. R(x, a) = r(x, a) - beta * log(pi_theta / pi_0)(a | x) is the regularised reward of a
whole response; at the optimum it is the same for every response of a prompt. Responses of one prompt
share a group id; baselines are leave-one-out statistics inside the group.
Shapes: logp, ref_logp, mask [B, T]; reward, group [B].
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_spo.algorithms.groups import leave_one_out_stats
from megatron_spo.algorithms.spo import _check_beta
from megatron_spo.algorithms.validation import check_token_inputs, upcast


def sequence_logp(logp: Tensor, valid: Tensor) -> Tensor:
    """log pi(a | x) = sum of token log-probs over response tokens, [B]."""
    return torch.where(valid, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(1)


def regularised_reward(logp: Tensor, ref_logp: Tensor, valid: Tensor, reward: Tensor, beta: float) -> Tensor:
    """R = r - beta * sum_t (logp - ref_logp) over response tokens, [B]."""
    return reward.to(logp.dtype) - beta * sequence_logp(logp - ref_logp, valid)


def agro_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    reward: Tensor,
    group: Tensor,
    *,
    beta: float,
    on_policy: bool,
) -> tuple[Tensor, dict[str, float]]:
    """AGRO surrogate loss (mean over sequences) whose gradient estimates grad 1/2 Var[R].

    off-policy (any behaviour): coef_i = -beta (R_i - b_i)
    on-policy (samples of pi):  coef_i = -beta (R_i - b_i) + 1/2 ((R_i - b_i)^2 - v_i)
    loss = mean_i stopgrad(coef_i) * log pi(a_i | x), b_i / v_i the leave-one-out mean / variance of R.
    """
    where = "agro_loss"
    _check_beta(where, beta)
    valid = check_token_inputs(
        where, mask, {"logp": logp, "ref_logp": ref_logp}, {"reward": reward, "group": group}
    )
    logp, ref_logp = upcast(logp), upcast(ref_logp)
    seq_logp = sequence_logp(logp, valid)
    with torch.no_grad():
        big_r = regularised_reward(logp, ref_logp, valid, reward, beta)
        r_minus_b, var_others, group_var = leave_one_out_stats(big_r, group, 3 if on_policy else 2, where)
        coef = -beta * r_minus_b
        if on_policy:
            coef = coef + 0.5 * (r_minus_b**2 - var_others)
    loss = (coef * seq_logp).mean()
    with torch.no_grad():
        stats = torch.stack(
            [
                loss.detach(),
                0.5 * group_var.mean(),
                big_r.mean(),
                sequence_logp(logp - ref_logp, valid).mean(),
            ]
        ).tolist()
    names = ("loss", "half_var_regularised_reward", "mean_regularised_reward", "mean_seq_log_ratio")
    return loss, dict(zip(names, stats, strict=True))


def kl_pg_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    reward: Tensor,
    group: Tensor,
    *,
    beta: float,
) -> tuple[Tensor, dict[str, float]]:
    """KL-regularised policy gradient with a leave-one-out reward baseline (the AGRO paper's baseline).

    loss = mean_i [ -stopgrad(r_i - b_i) log pi(a_i | x) + beta * sum_t (logp - ref_logp)_t ],
    i.e. step = (1/n) sum_i (r_i - b_i) grad log pi(a_i) - beta grad sum_t log(pi / pi_0)(a_t).
    Correct on-policy; on off-policy data it converges to the wrong policy.
    """
    where = "kl_pg_loss"
    _check_beta(where, beta)
    valid = check_token_inputs(
        where, mask, {"logp": logp, "ref_logp": ref_logp}, {"reward": reward, "group": group}
    )
    logp, ref_logp = upcast(logp), upcast(ref_logp)
    seq_logp = sequence_logp(logp, valid)
    seq_log_ratio = sequence_logp(logp - ref_logp, valid)
    with torch.no_grad():
        r_minus_b, _, _ = leave_one_out_stats(reward.to(logp.dtype), group, 2, where)
    loss = (-r_minus_b * seq_logp + beta * seq_log_ratio).mean()
    stats = torch.stack([loss.detach(), reward.to(logp.dtype).mean(), seq_log_ratio.detach().mean()]).tolist()
    return loss, dict(zip(("loss", "mean_reward", "mean_seq_log_ratio"), stats, strict=True))
