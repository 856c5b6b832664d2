"""Soft Policy Optimization: cumulative Q-parameterisation, Q0 estimates, losses and objectives.

Notation (MATH.md section 2): A_t = beta * (log pi_theta - log pi_0)(a_t), Q_t = Q0 + sum_{t' <= t} A_t'.
Shapes: logp, ref_logp, mask are [B, T] (mask != 0 marks response tokens); reward, q0 are [B].
Q values are in reward units; the cross-entropy and sigmoid losses work on log-probabilities Q / beta.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_spo.algorithms.groups import centred_on_others
from megatron_spo.algorithms.validation import check_token_inputs, upcast

OBJECTIVES = ("terminal", "reverse_q", "advantage", "mc")
# Objectives whose per-sequence loss is a function of Q_T alone: their gradient is coefficient * grad Q_T, the
# coefficient a group-centred control variate can replace (MATH.md section 7).
CENTRABLE_OBJECTIVES = ("terminal", "advantage")
# spo_loss's metrics, each a mean over the batch's sequences except mean_token_advantage (over its tokens)
METRIC_NAMES = ("loss", "terminal_q_abs_error", "mean_token_advantage", "mean_seq_log_ratio", "mean_q_terminal")
# (LOSSES: the names of REGRESSION_LOSSES, below.)
# Advantages r - Q0 can be positive, so they are not log-probabilities: no cross-entropy for them.
UNSUPPORTED = {
    ("advantage", "cross_entropy"): "advantages r - Q0 can be positive; use sigmoid_bce or squared"
}


def supported_combinations() -> list[tuple[str, str]]:
    """Every (objective, loss) pair spo_loss accepts."""
    return [(o, loss) for o in OBJECTIVES for loss in LOSSES if (o, loss) not in UNSUPPORTED]


def _check_beta(where: str, beta: float) -> None:
    if isinstance(beta, bool) or not (isinstance(beta, numbers.Real) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"{where}: beta must be a finite number > 0, got {beta!r}")


# ---------------------------------------------------------------------------------------------
# Cumulative Q and its targets
# ---------------------------------------------------------------------------------------------
def token_advantages(logp: Tensor, ref_logp: Tensor, mask: Tensor, beta: float) -> Tensor:
    """A_t = beta * (logp - ref_logp) on response tokens, exactly 0 on padding. [B, T], float32 or wider."""
    valid = mask if mask.dtype == torch.bool else mask != 0
    logp, ref_logp = upcast(logp), upcast(ref_logp)
    return torch.where(valid, beta * (logp - ref_logp), torch.zeros((), dtype=logp.dtype, device=logp.device))


def cumulative_q(logp: Tensor, ref_logp: Tensor, mask: Tensor, q0: Tensor, beta: float) -> Tensor:
    """Q_t = q0 + cumsum(A)_t, [B, T].

    Padding adds nothing, so a masked position holds the last valid Q (q0 before the first response token).
    """
    adv = token_advantages(logp, ref_logp, mask, beta)
    return q0.to(adv.dtype).unsqueeze(1) + adv.cumsum(dim=1)


def reverse_q_targets(logp: Tensor, ref_logp: Tensor, mask: Tensor, reward: Tensor, beta: float) -> Tensor:
    """R_t = detach(r - sum_{t' > t} A_t'), [B, T] (SPO paper 3.1.2).

    The suffix sum is a reversed cumsum (no total-minus-prefix cancellation in low precision).
    """
    adv = token_advantages(logp.detach(), ref_logp, mask, beta)
    suffix_inclusive = adv.flip(1).cumsum(1).flip(1)
    suffix_after = F.pad(suffix_inclusive[:, 1:], (0, 1))
    return reward.to(adv.dtype).unsqueeze(1) - suffix_after


def _as_float_tensor(x) -> Tensor:
    """Tensors keep their float dtype; Python numbers, lists and integer tensors become float64."""
    if isinstance(x, Tensor) and x.is_floating_point():
        return x
    return torch.as_tensor(x, dtype=torch.float64)


def q0_from_rewards(rewards: Tensor, beta: float) -> Tensor:
    """Monte-Carlo soft value beta * log mean_i exp(r_i / beta) over the LAST dim of rewards [..., N] -> [...]."""
    _check_beta("q0_from_rewards", beta)
    rewards = _as_float_tensor(rewards)
    if rewards.shape[-1] == 0:
        raise ValueError("q0_from_rewards: rewards has no samples (last dim is 0)")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError(
            f"q0_from_rewards: rewards has {int((~torch.isfinite(rewards)).sum())} non-finite values"
        )
    return beta * (torch.logsumexp(rewards / beta, dim=-1) - math.log(rewards.shape[-1]))


def q0_from_success(p: Tensor | float, beta: float) -> Tensor:
    """Soft value for rewards in {0 (success), -1}: beta * log(S + (1 - S) exp(-1/beta)), elementwise.

    Computed as logaddexp(log S, log(1 - S) - 1/beta): exact -1 at S = 0 and exact 0 at S = 1.
    """
    _check_beta("q0_from_success", beta)
    p = _as_float_tensor(p)
    if not bool(((p >= 0) & (p <= 1)).all()):
        raise ValueError("q0_from_success: p must lie in [0, 1] (a success probability)")
    log_success = torch.log(p)
    log_failure = torch.log1p(-p) - 1.0 / beta
    return beta * torch.logaddexp(log_success, log_failure)


# ---------------------------------------------------------------------------------------------
# Losses L(prediction, target), elementwise, both in Q (reward) units
# ---------------------------------------------------------------------------------------------
def straight_through_clamp_max(x: Tensor, max_value: float) -> Tensor:
    """min(x, max_value) in the forward pass, identity gradient in the backward pass."""
    return x.clamp(max=max_value).detach() + (x - x.detach())  # value exactly min(x, max): x - x == 0


def cross_entropy_log_space(pred_logp: Tensor, target_logp: Tensor, eps: float = 1e-6) -> Tensor:
    """Binary cross-entropy between probabilities given as log-probabilities (SPO paper 3.1.1).

    L = x * relu(-y_hat) - (1 - x) * log(1 - exp(y_hat_c)), x = exp(min(y, 0)) (no gradient),
    y_hat_c = min(y_hat, -eps) with a straight-through gradient. Minimised at y_hat = y.
    """
    target_logp = target_logp.detach().clamp(max=0.0)
    x = target_logp.exp()
    clipped = straight_through_clamp_max(pred_logp, -eps)
    return x * F.relu(-pred_logp) - (1.0 - x) * torch.log(-torch.expm1(clipped))


def _squared(pred_q: Tensor, target_q: Tensor, beta: float, eps: float) -> Tensor:
    return (pred_q - target_q) ** 2


def _cross_entropy(pred_q: Tensor, target_q: Tensor, beta: float, eps: float) -> Tensor:
    return cross_entropy_log_space(pred_q / beta, target_q / beta, eps)


def _sigmoid_bce(pred_q: Tensor, target_q: Tensor, beta: float, eps: float) -> Tensor:
    target_prob = torch.sigmoid(target_q.detach() / beta)
    return F.binary_cross_entropy_with_logits(pred_q / beta, target_prob, reduction="none")


# THE list of regression losses: name -> elementwise L(pred_q, target_q, beta, eps). A new variant is one entry
# here (config choices and the trainer derive from it); a user's own is a callable of the same signature.
REGRESSION_LOSSES: dict[str, Callable[[Tensor, Tensor, float, float], Tensor]] = {
    "squared": _squared,
    "cross_entropy": _cross_entropy,  # on log-probabilities Q / beta
    "sigmoid_bce": _sigmoid_bce,  # on logits Q / beta
}
LOSSES = tuple(REGRESSION_LOSSES)


def regression_loss(pred_q: Tensor, target_q: Tensor, loss: str | Callable, beta: float, eps: float = 1e-6) -> Tensor:
    """Elementwise L(pred, target) for Q values: a REGRESSION_LOSSES name or a callable of that signature."""
    if callable(loss):
        return loss(pred_q, target_q, beta, eps)
    if loss not in REGRESSION_LOSSES:
        raise ValueError(f"unknown loss '{loss}' (choose from {', '.join(LOSSES)})")
    return REGRESSION_LOSSES[loss](pred_q, target_q, beta, eps)


# ---------------------------------------------------------------------------------------------
# The SPO loss
# ---------------------------------------------------------------------------------------------
def _weighted_mean(per_sequence: Tensor, weights: Tensor | None) -> Tensor:
    if weights is None:
        return per_sequence.mean()
    return (per_sequence * weights).sum() / weights.sum()


def spo_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    reward: Tensor,
    q0: Tensor,
    *,
    beta: float,
    objective: str,
    loss: str | Callable,
    mc_positions: Tensor | None = None,
    mc_success: Tensor | None = None,
    mc_q: Tensor | None = None,
    weights: Tensor | None = None,
    per_token_mean: bool = False,
    centre_groups: Tensor | None = None,
    coefficient_baseline: Tensor | None = None,
    token_normalised: bool = False,
    trust_region: float | None = None,
    behaviour_logp: Tensor | None = None,
    pg_coef: float = 0.0,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """SPO loss, mean over sequences, and metrics (floats).

    logp, ref_logp, mask: [B, T]; reward, q0: [B].
    objective:
      terminal   L(Q_T, r)
      reverse_q  sum_t L(Q_t, R_t) over response tokens, R_t = detach(r - sum_{t' > t} A_t')
      advantage  L(sum_t A_t, r - q0)
      mc         sum_k L(Q_{t_k}, Q target_k) at annotated positions: mc_positions [B, K] (token index into
                 T, -1 = padding) with either mc_success [B, K] (success probabilities, rewards in {0, -1})
                 or mc_q [B, K] (Q targets in reward units).
    loss: a REGRESSION_LOSSES name (squared | cross_entropy | sigmoid_bce) or a callable L(pred_q, target_q, beta, eps).
    weights: optional [B] sequence weights (e.g. exact probabilities); default uniform.
    per_token_mean: for reverse_q / mc, average instead of sum the per-position terms of a sequence.
    centre_groups: optional [B] prompt-group ids (terminal / advantage only; a sequence alone in its group is
      centred on all the others: algorithms/groups.py centred_on_others). The
      gradient of a sequence's loss is c_i * grad Q_T with c_i = dL/dQ_T (2 (Q_T - r) for squared); centring
      replaces c_i by c_i - mean_{j in group, j != i} c_j (computed without gradient). On samples of a stale or
      tempered sampler mu the group mean of c drives KL(mu || pi) up (MATH.md section 7); centring removes that
      push, keeps pi* a fixed point (there c is equal within a group) and, on-policy, the expected gradient.
      The reported loss stays the uncentred regression loss.
    coefficient_baseline: optional [B], the same centring with the baseline given: c_i is replaced by
      c_i - coefficient_baseline_i (the trainer computes it over the whole step with terminal_coefficients, so
      micro-batches may cut a prompt group). Not with centre_groups.
    trust_region: with behaviour_logp [B, T] (log mu of the sampled tokens; rows of zeros = none), a PPO-style
      clip against the sampler (terminal / advantage only): a token's gradient is dropped once log(pi / mu) has
      moved past +-trust_region in the direction its sequence's coefficient pushes it, so one batch cannot carry
      the policy far from the distribution that sampled it. The loss value is unchanged.
    pg_coef: adds pg_coef * mean_i -stopgrad(r_i - b_i) log pi(y_i), a policy-gradient term with the leave-one-out
      reward baseline b_i of its group (centre_groups; else the whole batch), the paper's suggestion. It MOVES the
      fixed point from pi* towards higher reward (the PG term's gradient at pi* is not zero).
    token_normalised: weigh each sequence's loss by (mean response length / its length), so a long response
      no longer gets a larger gradient than a short one (every token's push is the same size); the batch's
      scale is unchanged and pi* (every residual 0) stays the optimum.
    """
    where = "spo_loss"
    if objective not in OBJECTIVES:
        raise ValueError(f"{where}: unknown objective '{objective}' (choose from {', '.join(OBJECTIVES)})")
    if not callable(loss) and loss not in REGRESSION_LOSSES:
        raise ValueError(f"{where}: unknown loss '{loss}' (choose from {', '.join(REGRESSION_LOSSES)})")
    if (objective, loss) in UNSUPPORTED:
        raise ValueError(
            f"{where}: objective '{objective}' with loss '{loss}' is not supported "
            f"({UNSUPPORTED[(objective, loss)]})"
        )
    _check_beta(where, beta)
    valid = check_token_inputs(
        where, mask, {"logp": logp, "ref_logp": ref_logp, "behaviour_logp": behaviour_logp},
        {"reward": reward, "q0": q0, "weights": weights}
    )
    logp, ref_logp = upcast(logp), upcast(ref_logp)
    if objective == "mc":
        mc_index, mc_targets, mc_valid = _mc_targets(where, mask, mc_positions, mc_success, mc_q, beta)
    elif any(x is not None for x in (mc_positions, mc_success, mc_q)):
        raise ValueError(f"{where}: mc_positions / mc_success / mc_q are only used by objective 'mc'")

    reward = reward.to(logp.dtype)
    q0 = q0.to(logp.dtype)
    fvalid = valid.to(logp.dtype)
    q = cumulative_q(logp, ref_logp, valid, q0, beta)
    q_terminal = q[:, -1]
    seq_log_ratio = q_terminal.detach() - q0  # = beta * sum_t log(pi / pi_0); divided by beta below

    if centre_groups is not None and coefficient_baseline is not None:
        raise ValueError(f"{where}: give centre_groups or coefficient_baseline, not both")
    centred = centre_groups is not None or coefficient_baseline is not None
    for name, given in (("centre_groups", centre_groups is not None),
                        ("coefficient_baseline", coefficient_baseline is not None),
                        ("trust_region", trust_region is not None)):
        if given and objective not in CENTRABLE_OBJECTIVES:
            raise ValueError(f"{where}: {name} needs objective {' or '.join(CENTRABLE_OBJECTIVES)}, "
                             f"not '{objective}' (its loss is not a function of Q_T alone)")
    if trust_region is not None and (behaviour_logp is None or not trust_region > 0):
        raise ValueError(f"{where}: trust_region needs a value > 0 and behaviour_logp (got {trust_region!r})")
    if objective in CENTRABLE_OBJECTIVES:
        of_q_terminal = _terminal_loss(objective, loss, reward, q0, beta, eps)
        per_sequence = of_q_terminal(q_terminal)
        coefficient = loss_coefficients(of_q_terminal, q_terminal)
        if centre_groups is not None:
            coefficient = centred_on_others(coefficient, centre_groups.to(q_terminal.device))
        elif coefficient_baseline is not None:
            if coefficient_baseline.shape != coefficient.shape:
                raise ValueError(f"{where}: coefficient_baseline has shape {tuple(coefficient_baseline.shape)}, "
                                 f"expected {tuple(coefficient.shape)}")
            coefficient = coefficient - coefficient_baseline.to(coefficient).detach()
        pushed_q = q_terminal
        if trust_region is not None:
            frozen = _outside_trust_region(logp, behaviour_logp, valid, coefficient, trust_region)
            clipped_share = float(frozen.sum() / fvalid.sum())
            pushed_q = cumulative_q(torch.where(frozen, logp.detach(), logp), ref_logp, valid, q0, beta)[:, -1]
        if centred or trust_region is not None:
            surrogate = coefficient * pushed_q  # gradient: coefficient * grad Q_T (frozen tokens: none); same value
            per_sequence = per_sequence.detach() + (surrogate - surrogate.detach())
    elif objective == "reverse_q":
        targets = reverse_q_targets(logp, ref_logp, valid, reward, beta)
        per_token = regression_loss(q, targets, loss, beta, eps)
        per_sequence = torch.where(valid, per_token, torch.zeros_like(per_token)).sum(1)
        if per_token_mean:
            per_sequence = per_sequence / fvalid.sum(1)
    else:
        q_at = q.gather(1, mc_index)
        per_target = regression_loss(q_at, mc_targets.to(q.dtype), loss, beta, eps)
        per_target = torch.where(mc_valid, per_target, torch.zeros_like(per_target))
        per_sequence = per_target.sum(1)
        if per_token_mean:
            per_sequence = per_sequence / mc_valid.sum(1).clamp(min=1).to(per_sequence.dtype)

    if token_normalised:
        lengths = fvalid.sum(1)
        per_sequence = per_sequence * (lengths.mean() / lengths)
    if pg_coef:
        groups = centre_groups if centre_groups is not None else torch.zeros_like(reward, dtype=torch.long)
        advantage = centred_on_others(reward, groups.to(reward.device)).detach()
        seq_logp = torch.where(valid, logp, torch.zeros((), dtype=logp.dtype, device=logp.device)).sum(1)
        per_sequence = per_sequence - pg_coef * advantage * seq_logp
    total = _weighted_mean(per_sequence, weights)
    with torch.no_grad():
        n_tokens = fvalid.sum()
        stats = torch.stack(
            [
                total.detach(),
                (q_terminal.detach() - reward).abs().mean(),
                (token_advantages(logp.detach(), ref_logp, valid, beta).sum() / n_tokens),
                (seq_log_ratio / beta).mean(),
                q_terminal.detach().mean(),
            ]
        ).tolist()  # one sync for all metrics
    metrics = dict(zip(METRIC_NAMES, stats, strict=True))
    if objective in CENTRABLE_OBJECTIVES:  # the size of each sequence's push, as used (centred or not)
        metrics["coefficient_abs"] = float(coefficient.abs().mean())
    if trust_region is not None:
        metrics["trust_region_clipped"] = clipped_share
    return total, metrics


def _outside_trust_region(logp: Tensor, behaviour_logp: Tensor, valid: Tensor, coefficient: Tensor,
                          limit: float) -> Tensor:
    """[B, T] bool: response tokens of rows with behaviour log-probs whose log(pi / mu) is already past -limit
    (coefficient > 0: descent lowers log pi) or +limit (coefficient < 0: descent raises it)."""
    behaviour_logp = upcast(behaviour_logp).to(logp.dtype)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    has_behaviour = (torch.where(valid, behaviour_logp, zero) != 0).any(1, keepdim=True)
    ratio = logp.detach() - behaviour_logp
    sign = coefficient.unsqueeze(1)
    past = ((sign > 0) & (ratio < -limit)) | ((sign < 0) & (ratio > limit))
    return past & valid & has_behaviour


def _terminal_loss(objective: str, loss: str | Callable, reward: Tensor, q0: Tensor, beta: float,
                   eps: float) -> Callable[[Tensor], Tensor]:
    """The per-sequence loss as a function of Q_T [B] -> [B] (terminal / advantage objectives)."""
    if objective == "terminal":
        return lambda q_t: regression_loss(q_t, reward, loss, beta, eps)
    return lambda q_t: regression_loss(q_t - q0, reward - q0, loss, beta, eps)


@torch.no_grad()
def terminal_coefficients(logp: Tensor, ref_logp: Tensor, mask: Tensor, reward: Tensor, q0: Tensor, *, beta: float,
                          objective: str, loss: str | Callable, eps: float = 1e-6) -> Tensor:
    """c_i = dL_i / dQ_T,i [B] of a terminal / advantage objective (what spo_loss centres), detached; shapes as
    spo_loss. The trainer takes prompt-group baselines of these over a whole step (coefficient_baseline)."""
    if objective not in CENTRABLE_OBJECTIVES:
        raise ValueError(f"terminal_coefficients: objective '{objective}' is not a function of Q_T alone "
                         f"(choose from {', '.join(CENTRABLE_OBJECTIVES)})")
    valid = mask if mask.dtype == torch.bool else mask != 0
    logp = upcast(logp)
    q0 = q0.to(logp.dtype)
    q_terminal = cumulative_q(logp, upcast(ref_logp), valid, q0, beta)[:, -1]
    return loss_coefficients(_terminal_loss(objective, loss, reward.to(logp.dtype), q0, beta, eps), q_terminal)


def loss_coefficients(of_q_terminal: Callable[[Tensor], Tensor], q_terminal: Tensor) -> Tensor:
    """c_i = dL_i / dQ_T,i for a per-sequence loss of Q_T [B] -> [B], detached (no graph kept)."""
    with torch.enable_grad():
        q = q_terminal.detach().requires_grad_(True)
        (coefficient,) = torch.autograd.grad(of_q_terminal(q).sum(), q)
    return coefficient


def _mc_targets(
    where: str,
    mask: Tensor,
    positions: Tensor | None,
    success: Tensor | None,
    q_targets: Tensor | None,
    beta: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """Validated (gather index [B, K] int64, Q targets [B, K], bool [B, K] of annotated entries)."""
    if positions is None:
        raise ValueError(f"{where}: objective 'mc' needs mc_positions [B, K] (-1 = no target)")
    if (success is None) == (q_targets is None):
        raise ValueError(f"{where}: objective 'mc' needs exactly one of mc_success or mc_q")
    name, values = ("mc_success", success) if success is not None else ("mc_q", q_targets)
    if positions.dim() != 2 or positions.shape[0] != mask.shape[0]:
        raise ValueError(f"{where}: mc_positions shape {tuple(positions.shape)} is not [{mask.shape[0]}, K]")
    if values.shape != positions.shape:
        raise ValueError(
            f"{where}: {name} shape {tuple(values.shape)} != mc_positions shape {tuple(positions.shape)}"
        )
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{where}: mc_positions must be an integer tensor, got {positions.dtype}")
    annotated = positions >= 0
    t_max = mask.shape[1]
    valid = mask if mask.dtype == torch.bool else mask != 0
    on_token = valid.gather(1, positions.clamp(min=0, max=t_max - 1).long())
    ok = torch.stack(
        [
            (positions < t_max).all(),
            (positions >= -1).all(),
            (on_token | ~annotated).all(),
            (torch.isfinite(values) | ~annotated).all(),
            ((values >= 0) & (values <= 1) | ~annotated).all()
            if success is not None
            else annotated.new_ones(()),
        ]
    ).tolist()
    problems = [
        f"mc_positions has indices >= T = {t_max}",
        "mc_positions has values < -1 (-1 marks no target)",
        "mc_positions points at padding (mask 0)",
        f"{name} has non-finite values at annotated positions",
        "mc_success has values outside [0, 1]",
    ]
    for good, problem in zip(ok, problems, strict=True):
        if not good:
            raise ValueError(f"{where}: {problem}")
    index = positions.long().clamp(min=0)
    if success is not None:
        targets = q0_from_success(torch.where(annotated, success, torch.ones_like(success)), beta)
    else:
        targets = torch.where(annotated, q_targets, torch.zeros_like(q_targets))
    return index, targets, annotated
