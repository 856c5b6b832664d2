"""PPO baseline pieces (SPO paper 3.1.4): KL-regularised token rewards, GAE, clipped surrogate, value loss.

Shapes: [B, T] per token with mask != 0 on the response tokens the model sampled (a multi-turn response's
environment tokens are 0 inside it); [B] per sequence.
Sequence-level reduction (default) sums over a response's tokens and averages over sequences, matching
the gradient of an undiscounted sequence objective; "token" averages over all response tokens instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_spo.algorithms.behaviour_correction import (
    behaviour_weights,
    check_correction,
    correction_metrics,
)
from megatron_spo.algorithms.spo import _check_beta
from megatron_spo.algorithms.validation import check_token_inputs, upcast

REDUCTIONS = ("sequence", "token")


def _reduce(per_token: Tensor, valid: Tensor, reduction: str, where: str) -> Tensor:
    per_token = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if reduction == "sequence":
        return per_token.sum(1).mean()
    if reduction == "token":
        return per_token.sum() / valid.sum()
    raise ValueError(f"{where}: unknown reduction '{reduction}' (choose from {', '.join(REDUCTIONS)})")


def kl_regularised_token_rewards(
    reward: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, *, beta: float
) -> Tensor:
    """Per-token rewards [B, T]: -beta * (logp - ref_logp) on every response token, plus the sequence
    reward r on its last response token; 0 on padding. logp is the behaviour policy's log-probs."""
    where = "kl_regularised_token_rewards"
    _check_beta(where, beta)
    valid = check_token_inputs(where, mask, {"logp": logp, "ref_logp": ref_logp}, {"reward": reward})
    logp, ref_logp = upcast(logp), upcast(ref_logp)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    rewards = torch.where(valid, -beta * (logp - ref_logp), zero)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(valid)
    last = torch.where(valid, positions, -1).max(dim=1).values
    return rewards.scatter_add(1, last.unsqueeze(1), reward.to(logp.dtype).unsqueeze(1))


def whiten_over_batch(advantages: list[Tensor], masks: list[Tensor],
                      sum_across: Callable[[Tensor], Tensor] = lambda t: t) -> list[Tensor]:
    """(A - mean) / std over every response token of the step: all micro-batches ([B, T] each, with their masks)
    and, through ``sum_across`` (a sum over data-parallel ranks), all ranks. Whitening each micro-batch on its own
    would make the update depend on how the step was packed and sharded. Two passes (mean, then squared
    deviations) in float64; 0 on padding."""
    valid = [m.bool() for m in masks]
    device = advantages[0].device

    def total(values: list[Tensor]) -> Tensor:
        return sum_across(torch.stack([torch.stack([v.double().sum() for v in values]).sum(),
                                       torch.tensor(float(sum(v.numel() for v in values)), dtype=torch.float64,
                                                    device=device)]))

    mean_stats = total([a[v] for a, v in zip(advantages, valid)])
    if mean_stats[1] == 0:
        raise ValueError("whiten_over_batch: no response tokens in the step")
    mean = mean_stats[0] / mean_stats[1]
    var = total([(a[v].double() - mean) ** 2 for a, v in zip(advantages, valid)])[0] / mean_stats[1]
    std = var.sqrt().clamp(min=1e-6)
    return [torch.where(v, ((a.double() - mean) / std).to(a.dtype), torch.zeros_like(a))
            for a, v in zip(advantages, valid)]


def discounted_reverse_cumsum(x: Tensor, discount: float, chunk: int = 256) -> Tensor:
    """y_t = sum_{k >= t} discount^(k - t) x_k along dim 1 of x [B, T].

    A scan in chunks: inside a chunk one [L, L] triangular matmul, across chunks a carried value, so a
    4096-token response costs 16 small matmuls instead of 4096 sequential steps (GPU kernel launches).
    discount^(k - t) stays inside one chunk, so nothing underflows for long sequences.
    """
    batch, length = x.shape
    idx = torch.arange(min(chunk, length), device=x.device)
    lag = (idx[None, :] - idx[:, None]).to(x.dtype)  # k - t
    weights = torch.where(lag >= 0, torch.full_like(lag, discount) ** lag.clamp(min=0), torch.zeros_like(lag))
    out = torch.empty_like(x)
    carry = x.new_zeros(batch)  # y at the first position of the chunk to the right
    for end in range(length, 0, -chunk):
        start = max(0, end - chunk)
        size = end - start
        steps_to_end = (size - idx[:size]).to(x.dtype)
        y = x[:, start:end] @ weights[:size, :size].T + carry[:, None] * discount**steps_to_end
        out[:, start:end] = y
        carry = y[:, 0]
    return out


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation. Returns (advantages, returns), each [B, T], 0 on padding.

    values[b, t] = V(state before token t). The state after the last response token is terminal (V = 0).
    delta_t = r_t + gamma V_{t+1} - V_t;  A_t = delta_t + gamma lam A_{t+1};  returns = A + V, over the valid
    tokens in order: a multi-turn response's environment tokens (mask 0 inside it) are context, so t + 1 is the next
    model token and the observation between them is part of the transition.
    """
    where = "gae"
    valid = check_token_inputs(where, mask, {"token_rewards": token_rewards, "values": values})
    token_rewards, values = upcast(token_rewards), upcast(values)
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"{where}: gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    # each row's valid tokens moved to its front, in order (stable): one contiguous span, then back
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices
    valid = valid.gather(1, order)
    token_rewards, values = token_rewards.gather(1, order), values.gather(1, order)
    advantages, returns = _gae_contiguous(token_rewards, values, valid, gamma, lam)
    return (torch.zeros_like(advantages).scatter(1, order, advantages),
            torch.zeros_like(returns).scatter(1, order, returns))


def _gae_contiguous(token_rewards: Tensor, values: Tensor, valid: Tensor, gamma: float, lam: float
                    ) -> tuple[Tensor, Tensor]:
    """gae of rows whose valid tokens are one span at the front."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    rewards = torch.where(valid, token_rewards, zero)
    vals = torch.where(valid, values, zero)
    next_vals = torch.nn.functional.pad(vals[:, 1:], (0, 1))  # 0 after the last token: terminal
    deltas = torch.where(valid, rewards + gamma * next_vals - vals, zero)
    advantages = torch.where(valid, discounted_reverse_cumsum(deltas, gamma * lam), zero)
    return advantages, torch.where(valid, advantages + vals, zero)


def ppo_policy_loss(
    logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    reduction: str = "sequence",
    old_logp: Tensor | None = None,
    correction: str = "none",
    correction_cap: float = 2.0,
    correction_level: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate -min(w A, clip(w, 1 - eps, 1 + eps_high) A), w = exp(logp - behaviour_logp).

    behaviour_logp: the log-probs the rollout engine reported for the sampled tokens (pi_theta_old).
    Stale samples (behaviour_correction.py): with old_logp (pi_old, no grad) the ratio is exp(logp - old_logp)
    and a correction ("tis" | "mis") weights each token's term by min(pi_old / mu, C) or drops it where
    pi_old / mu leaves [1/C, C] (mu = behaviour_logp); metrics then add behaviour_weight, behaviour_corrected
    and mismatch_kl.
    """
    where = "ppo_policy_loss"
    check_correction(where, correction, correction_cap, correction_level)
    if correction != "none" and old_logp is None:
        raise ValueError(f"{where}: behaviour correction '{correction}' needs old_logp (the policy's log-probs "
                         "at the start of the step)")
    valid = check_token_inputs(
        where, mask, {"logp": logp, "behaviour_logp": behaviour_logp, "advantages": advantages, "old_logp": old_logp}
    )
    logp, behaviour_logp, advantages = upcast(logp), upcast(behaviour_logp), upcast(advantages)
    denominator = behaviour_logp if old_logp is None else upcast(old_logp)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    if not (0 < clip_eps < 1 and high > 0):
        raise ValueError(
            f"{where}: clip_eps must lie in (0, 1) and clip_eps_high be > 0, got {clip_eps}, {high}"
        )
    fvalid = valid.to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp - denominator.detach(), zero)
    adv = torch.where(valid, advantages.detach(), zero)
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    extra: dict[str, float] = {}
    if correction != "none":
        w, corrected, mismatch = behaviour_weights(old_logp, behaviour_logp, valid, correction=correction,
                                                   cap=correction_cap, level=correction_level)
        per_token = per_token * w.to(per_token.dtype)
        extra = correction_metrics(w, corrected, mismatch, valid)
    loss = _reduce(per_token, valid, reduction, where)
    with torch.no_grad():
        n = fvalid.sum()
        stats = torch.stack(
            [
                loss.detach(),
                ((clipped < unclipped).to(fvalid.dtype) * fvalid).sum() / n,
                # k3 estimator of KL(old || new): E_old[(w - 1) - log w]
                (((ratio - 1) - log_ratio) * fvalid).sum() / n,
                (ratio * fvalid).sum() / n,
            ]
        ).tolist()
    return loss, {**dict(zip(("loss", "clip_fraction", "approx_kl_old_new", "mean_ratio"), stats, strict=True)),
                  **extra}


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_eps: float | None = None,
    reduction: str = "sequence",
) -> Tensor:
    """1/2 (V - G)^2, or with clip_eps the pessimistic 1/2 max((V - G)^2, (V_clip - G)^2),
    V_clip = old_values + clamp(V - old_values, -eps, eps)."""
    where = "ppo_value_loss"
    valid = check_token_inputs(where, mask, {"values": values, "old_values": old_values, "returns": returns})
    values, old_values, returns = upcast(values), upcast(old_values), upcast(returns)
    returns = returns.detach()
    per_token = (values - returns) ** 2
    if clip_eps is not None:
        if clip_eps <= 0:
            raise ValueError(f"{where}: clip_eps must be > 0 or None, got {clip_eps}")
        old = old_values.detach()
        clipped = old + (values - old).clamp(-clip_eps, clip_eps)
        per_token = torch.maximum(per_token, (clipped - returns) ** 2)
    return 0.5 * _reduce(per_token, valid, reduction, where)
