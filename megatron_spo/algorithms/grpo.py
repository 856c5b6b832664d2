"""GRPO (DeepSeekMath, Shao et al. 2024): group-normalised advantages, clipped importance ratio, optional KL.

For the samples of one prompt (a group) with rewards r_i, the advantage of every token of sample i is
    A_i = (r_i - mean_group(r)) / (std_group(r) + eps)        (scale_rewards=False: r_i - mean, "Dr. GRPO")
and the per-token objective, with ratio rho_t = exp(log pi_theta - log pi_behaviour)(a_t), is
    l_t = -min(rho_t A_i, clip(rho_t, 1 - eps_low, 1 + eps_high) A_i) + beta * k3_t,
    k3_t = exp(log pi_0 - log pi_theta) - (log pi_0 - log pi_theta) - 1     (>= 0, unbiased KL(pi || pi_0))
aggregated as "sequence_mean" (mean over a sequence's tokens, then over sequences: the paper) or
"token_mean" (sum over every response token / their number: DAPO, TRL's default "dapo"-like loss).
Stale samples (behaviour_correction.py): with old_logp (pi_old, the trainer's policy at the start of the step)
the ratio is pi_theta / pi_old and each token's whole term (surrogate and KL penalty, both estimates over the
policy's samples) is weighted by w_t = min(pi_old / mu, C) ("tis") or dropped where pi_old / mu leaves
[1/C, C] ("mis"); a dropped token still counts in the normaliser. correction "none" with old_logp None is the
on-policy loss above.
Guided rows (LUFFY, Yan et al. 2025, "Learning to Reason under Off-Policy Guidance"): demonstrations spliced into a
prompt's group (expert text, another model's samples) take their advantage from the mixed group like any row, and
their term, with p_t = exp(log pi_theta(a_t)) (the demonstrator's probability is taken as 1: expert text has none),
    l_t = -f(p_t) A_i,   f(p) = p / (p + gamma)       (policy shaping, gamma 0.1: LUFFY's default)
unclipped, with no behaviour weight and no KL term (k3 estimates KL(pi || pi_0) on the policy's own samples only).
d l_t / d log p_t = -A_i gamma p / (p + gamma)^2: largest at p = gamma, so tokens the policy finds unlikely get more
of the push than under the plain ratio p (whose gradient p vanishes as p -> 0).
Shapes: [B, T] per token (mask != 0 on response tokens), [B] per sequence, group [B] long ids.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from megatron_spo.algorithms.behaviour_correction import behaviour_weights, check_correction
from megatron_spo.algorithms.validation import check_token_inputs, upcast

AGGREGATIONS = ("sequence_mean", "token_mean")


def grpo_advantages(reward: Tensor, group: Tensor, *, scale_rewards: bool = True, eps: float = 1e-4) -> Tensor:
    """[B] group-normalised advantages. A group of one sample has advantage 0 (nothing to compare with); the
    std is torch.std's unbiased one, as TRL's GRPOTrainer computes it."""
    reward = reward.to(torch.float64)
    out = torch.zeros_like(reward)
    for g in torch.unique(group):
        rows = group == g
        r = reward[rows]
        if r.numel() < 2:
            continue
        centred = r - r.mean()
        out[rows] = centred / (r.std() + eps) if scale_rewards else centred
    return out.to(torch.float32)


def shaped_probability(logp: Tensor, gamma: float) -> Tensor:
    """LUFFY's policy shaping f(p) = p / (p + gamma) of p = exp(logp), elementwise; written as
    1 / (1 + gamma e^{-logp}) so a log-prob of -1000 gives 0, not 0 / gamma."""
    return torch.sigmoid(logp - math.log(gamma))


def grpo_token_losses(logp: Tensor, behaviour_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor,
                      mask: Tensor, *, clip_eps_low: float, clip_eps_high: float, beta: float,
                      old_logp: Tensor | None = None, correction: str = "none", correction_cap: float = 2.0,
                      correction_level: str = "token", guided: Tensor | None = None,
                      shaping_gamma: float = 0.1) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(per-token losses [B, T] (0 off the mask), valid mask [B, T] bool, per-token stats for metrics).

    old_logp [B, T] (no grad): pi_old for the ratio, required by a correction; without it the ratio is
    against behaviour_logp. A correction adds stats behaviour_weight, behaviour_corrected and mismatch_k3.
    guided [B] bool: demonstration rows (module docstring), their term -f(p_t) A_i with f(p) = p / (p +
    shaping_gamma); adds stat shaped_p (f(p_t) on those rows, 0 elsewhere)."""
    where = "grpo_token_losses"
    check_correction(where, correction, correction_cap, correction_level)
    if guided is not None and (guided.shape != advantages.shape or guided.dtype != torch.bool):
        raise ValueError(f"{where}: guided must be a bool tensor of shape {tuple(advantages.shape)}, got "
                         f"{guided.dtype} {tuple(guided.shape)}")
    if not shaping_gamma > 0:
        raise ValueError(f"{where}: shaping_gamma must be > 0, got {shaping_gamma}")
    if correction != "none" and old_logp is None:
        raise ValueError(f"{where}: behaviour correction '{correction}' needs old_logp (the policy's log-probs "
                         "at the start of the step)")
    tensors = {"logp": logp, "behaviour_logp": behaviour_logp, "old_logp": old_logp}
    if ref_logp is not None:
        tensors["ref_logp"] = ref_logp
    valid = check_token_inputs(where, mask, tensors, {"advantages": advantages})
    if clip_eps_low <= 0 or clip_eps_high <= 0 or beta < 0:
        raise ValueError(f"{where}: clip_eps_low/high must be > 0 and beta >= 0, got {clip_eps_low}, "
                         f"{clip_eps_high}, {beta}")
    logp, behaviour_logp = upcast(logp), upcast(behaviour_logp)
    denominator = behaviour_logp if old_logp is None else upcast(old_logp).detach()
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp - denominator, zero)
    ratio = log_ratio.exp()
    adv = advantages.to(logp.dtype).unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high) * adv)
    per_token = -surrogate
    stats = {"clipped": ((ratio - ratio.clamp(1 - clip_eps_low, 1 + clip_eps_high)).abs() > 0) & valid,
             "approx_kl_old_new": (ratio - 1) - log_ratio}
    own = valid if guided is None else valid & ~guided.to(valid.device).unsqueeze(1)  # the policy's samples
    if ref_logp is not None:
        d = torch.where(own, upcast(ref_logp) - logp, zero)
        k3 = d.exp() - d - 1
        stats["kl_ref"] = k3.detach()
        if beta > 0:
            per_token = per_token + beta * k3
    if correction != "none":
        w, corrected, mismatch = behaviour_weights(old_logp, behaviour_logp, own, correction=correction,
                                                   cap=correction_cap, level=correction_level)
        per_token = per_token * torch.where(own, w, torch.ones_like(w)).to(per_token.dtype)
        stats.update(behaviour_weight=w, behaviour_corrected=corrected, mismatch_k3=mismatch)
    if guided is not None:
        demo = valid & ~own
        shaped = shaped_probability(torch.where(demo, logp, zero), shaping_gamma)
        per_token = torch.where(demo, -shaped * adv, per_token)
        stats["shaped_p"] = torch.where(demo, shaped, zero).detach()
        stats["clipped"] = stats["clipped"] & own
        stats["approx_kl_old_new"] = torch.where(own, stats["approx_kl_old_new"], zero)
    return torch.where(valid, per_token, zero), valid, stats


def aggregate(per_token: Tensor, valid: Tensor, aggregation: str) -> tuple[Tensor, Tensor]:
    """(sum of the batch's contributions, its normaliser): sequence_mean -> (sum_i mean_t l, B),
    token_mean -> (sum_{i,t} l, number of response tokens). The loss is sum / normaliser; keeping the two
    apart lets a trainer normalise over a global batch split into micro-batches."""
    if aggregation == "sequence_mean":
        per_sequence = per_token.sum(1) / valid.sum(1).clamp(min=1)
        return per_sequence.sum(), torch.tensor(float(per_token.shape[0]))
    if aggregation == "token_mean":
        return per_token.sum(), valid.sum().to(per_token.dtype)
    raise ValueError(f"grpo: unknown aggregation '{aggregation}' (choose from {', '.join(AGGREGATIONS)})")
