"""Soft Policy Optimization: cumulative Q-parameterisation, Q0 estimates, losses, objectives and their composition.

Notation (MATH.md section 2): A_t = beta * (log pi_theta - log pi_0)(a_t), Q_t = Q0 + sum_{t' <= t} A_t'.
Shapes: logp, ref_logp, mask are [B, T] (mask != 0 marks response tokens); reward, q0 are [B].
Q values are in reward units; the cross-entropy and sigmoid losses work on log-probabilities Q / beta.

    loss, metrics = spo_loss(SPOInputs(logp, ref_logp, mask, reward, q0, group=group), beta=beta,
                             objective="terminal", loss="squared", transforms=[centre_groups])

reads as the math: an objective gives (prediction, target) pairs (OBJECTIVE_PAIRS), a loss L(prediction, target)
(REGRESSION_LOSSES) each sequence's L_i and, for an objective of Q_T alone, its coefficient c_i = dL_i / dQ_T,i;
coefficient transforms (spo_transforms.py) change c_i, the tokens it reaches, or add to L_i.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_spo.algorithms.validation import check_token_inputs, upcast

# (OBJECTIVES: the names of OBJECTIVE_PAIRS, below.)
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
# Inputs, and the objectives: what each regresses, as (prediction, target) pairs in Q units
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SPOInputs:
    """One batch of sequences. Per token [B, T]: logp, ref_logp (log pi, log pi_0 of the sampled tokens), mask
    (!= 0 on response tokens), behaviour_logp (log mu of the sampler, rows of zeros = none; the trust region's),
    sampler_logp (the policy's own log-probs at each row's sampling temperature, log softmax(logits / T), no grad:
    what the trust region compares with behaviour_logp, both being of one distribution; None: logp, rows at T = 1).
    Per sequence [B]: reward, q0, group (prompt-group ids: centring's and the policy-gradient term's groups; None:
    one group), coefficient_baseline (the baselines coefficient_baseline subtracts), weights (default uniform).
    Objective 'mc': mc_positions [B, K] (token index into T, -1 = no target) with mc_success [B, K] (success
    probabilities, rewards in {0, -1}) or mc_q [B, K] (Q targets in reward units)."""

    logp: Tensor
    ref_logp: Tensor
    mask: Tensor
    reward: Tensor
    q0: Tensor
    group: Tensor | None = None
    coefficient_baseline: Tensor | None = None
    behaviour_logp: Tensor | None = None
    sampler_logp: Tensor | None = None
    mc_positions: Tensor | None = None
    mc_success: Tensor | None = None
    mc_q: Tensor | None = None
    weights: Tensor | None = None


@dataclass(frozen=True)
class Pairs:
    """What an objective regresses: L(prediction, target) elementwise, prediction [B] or [B, K] (with gradient),
    target (none); valid [B, K]: the pairs that count (None: one per sequence); of_q_terminal: the prediction as a
    function of Q_T [B] -> [B] when it depends on nothing else (its coefficient dL/dQ_T can be transformed)."""

    prediction: Tensor
    target: Tensor
    valid: Tensor | None = None
    of_q_terminal: Callable[[Tensor], Tensor] | None = None


def _terminal(q: Tensor, inputs: SPOInputs, beta: float, where: str) -> Pairs:
    return Pairs(q[:, -1], inputs.reward, of_q_terminal=lambda q_t: q_t)


def _reverse_q(q: Tensor, inputs: SPOInputs, beta: float, where: str) -> Pairs:
    i = inputs
    return Pairs(q, reverse_q_targets(i.logp, i.ref_logp, i.mask, i.reward, beta), valid=i.mask)


def _advantage(q: Tensor, inputs: SPOInputs, beta: float, where: str) -> Pairs:
    q0 = inputs.q0
    return Pairs(q[:, -1] - q0, inputs.reward - q0, of_q_terminal=lambda q_t: q_t - q0)


def _mc(q: Tensor, inputs: SPOInputs, beta: float, where: str) -> Pairs:
    i = inputs
    index, targets, annotated = _mc_targets(where, i.mask, i.mc_positions, i.mc_success, i.mc_q, beta)
    return Pairs(q.gather(1, index), targets.to(q.dtype), valid=annotated)


# THE objectives (SPO paper 3.1.2-3.1.3): name -> (Q [B, T], inputs, beta, where) -> Pairs
OBJECTIVE_PAIRS: dict[str, Callable[[Tensor, SPOInputs, float, str], Pairs]] = {
    "terminal": _terminal,  # L(Q_T, r)
    "reverse_q": _reverse_q,  # sum_t L(Q_t, R_t) over response tokens, R_t = detach(r - sum_{t' > t} A_t')
    "advantage": _advantage,  # L(sum_t A_t, r - Q0)
    "mc": _mc,  # sum_k L(Q_{t_k}, Q target_k) at the annotated positions
}
OBJECTIVES = tuple(OBJECTIVE_PAIRS)


# ---------------------------------------------------------------------------------------------
# The SPO loss: targets, residual, coefficient, loss
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SPOTerms:
    """One batch's SPO loss in parts, what a coefficient transform (algorithms/spo_transforms.py) reads and
    changes. inputs: validated, log-probs upcast, reward and q0 in their dtype, mask bool; q: Q_t [B, T];
    per_sequence: L_i [B] with its own gradient; coefficient: c_i = dL_i / dQ_T,i [B] (detached; None unless the
    objective is a function of Q_T alone); frozen: [B, T] tokens the coefficient does not reach; scale: a factor
    of each L_i; added: a term added to each L_i (own gradient); metrics: floats reported with the loss.
    Change them with replace(): a coefficient or frozen tokens set there make each sequence's gradient
    c_i * grad Q_T,i over the tokens not frozen (its loss value stays L_i)."""

    inputs: SPOInputs
    beta: float
    objective: str
    q: Tensor
    per_sequence: Tensor
    coefficient: Tensor | None
    frozen: Tensor | None = None
    scale: Tensor | None = None
    added: Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    surrogate: bool = False  # set by replace(coefficient=..., frozen=...)
    centred_by: str | None = None  # the centring transform that ran (one at most)
    where: str = "spo_loss"

    def replace(self, **changes) -> SPOTerms:
        if "coefficient" in changes or "frozen" in changes:
            self.need_coefficient("a transform changing the coefficient or freezing tokens")
            changes["surrogate"] = True
        return dataclasses.replace(self, **changes)

    def need_coefficient(self, name: str) -> Tensor:
        """The coefficient, or a ValueError naming transform `name` when the objective has none."""
        if self.coefficient is None:
            raise ValueError(f"{self.where}: {name} needs objective {' or '.join(CENTRABLE_OBJECTIVES)}, not "
                             f"'{self.objective}' (its loss is not a function of Q_T alone)")
        return self.coefficient

    def need_input(self, name: str, input_name: str) -> Tensor:
        """inputs.<input_name>, or a ValueError naming transform `name` when it is not given."""
        value = getattr(self.inputs, input_name)
        if value is None:
            raise ValueError(f"{self.where}: {name} needs inputs.{input_name}")
        return value

    def scaled(self, factor: Tensor) -> SPOTerms:
        return self.replace(scale=factor if self.scale is None else self.scale * factor)

    def plus(self, term: Tensor) -> SPOTerms:
        return self.replace(added=term if self.added is None else self.added + term)


Transform = Callable[[SPOTerms], SPOTerms]


def _weighted_mean(per_sequence: Tensor, weights: Tensor | None) -> Tensor:
    if weights is None:
        return per_sequence.mean()
    return (per_sequence * weights).sum() / weights.sum()


def spo_loss(inputs: SPOInputs, *, beta: float, objective: str, loss: str | Callable,
             transforms: Sequence[Transform] = (), eps: float = 1e-6) -> tuple[Tensor, dict[str, float]]:
    """SPO loss, mean over sequences (weighted by inputs.weights), and metrics (floats).

    objective: an OBJECTIVE_PAIRS name; loss: a REGRESSION_LOSSES name (squared | cross_entropy | sigmoid_bce) or a
    callable L(pred_q, target_q, beta, eps). Each sequence's loss L_i sums L over its (prediction, target) pairs;
    transforms (spo_transforms.py: centre_groups, coefficient_baseline, trust_region, token_normalise,
    policy_gradient, or a user's own function SPOTerms -> SPOTerms) change its coefficient or add to it, in order.
    The loss of sequence i is then (L_i, or the surrogate with gradient c_i * grad Q_T,i) * scale_i + added_i.
    """
    where = "spo_loss"
    _check_choice(where, objective, loss)
    _check_beta(where, beta)
    i = inputs
    valid = check_token_inputs(where, i.mask,
                               {"logp": i.logp, "ref_logp": i.ref_logp, "behaviour_logp": i.behaviour_logp,
                                "sampler_logp": i.sampler_logp},
                               {"reward": i.reward, "q0": i.q0, "weights": i.weights})
    if objective != "mc" and any(x is not None for x in (i.mc_positions, i.mc_success, i.mc_q)):
        raise ValueError(f"{where}: mc_positions / mc_success / mc_q are only used by objective 'mc'")
    i = _prepared(i, valid)
    q = cumulative_q(i.logp, i.ref_logp, i.mask, i.q0, beta)
    pairs = OBJECTIVE_PAIRS[objective](q, i, beta, where)
    per_pair = regression_loss(pairs.prediction, pairs.target, loss, beta, eps)
    per_sequence = per_pair if pairs.valid is None else torch.where(
        pairs.valid, per_pair, torch.zeros_like(per_pair)).sum(1)
    coefficient = None if pairs.of_q_terminal is None else _coefficient(pairs, q[:, -1], loss, beta, eps)
    terms = SPOTerms(i, beta, objective, q, per_sequence, coefficient)
    for transform in transforms:
        terms = transform(terms)
    if terms.coefficient is not coefficient or terms.frozen is not None:  # also when set by dataclasses.replace
        terms = dataclasses.replace(terms, surrogate=True)
    total = _weighted_mean(_assembled(terms), i.weights)
    return total, _metrics(terms, total)


def _check_choice(where: str, objective: str, loss: str | Callable) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"{where}: unknown objective '{objective}' (choose from {', '.join(OBJECTIVES)})")
    if not callable(loss) and loss not in REGRESSION_LOSSES:
        raise ValueError(f"{where}: unknown loss '{loss}' (choose from {', '.join(REGRESSION_LOSSES)})")
    if (objective, loss) in UNSUPPORTED:
        raise ValueError(
            f"{where}: objective '{objective}' with loss '{loss}' is not supported "
            f"({UNSUPPORTED[(objective, loss)]})"
        )


def _prepared(inputs: SPOInputs, valid: Tensor) -> SPOInputs:
    """Log-probs upcast (bf16 -> float32), reward and q0 in their dtype, the mask bool."""
    logp = upcast(inputs.logp)
    return dataclasses.replace(inputs, logp=logp, ref_logp=upcast(inputs.ref_logp), mask=valid,
                               reward=inputs.reward.to(logp.dtype), q0=inputs.q0.to(logp.dtype))


def _coefficient(pairs: Pairs, q_terminal: Tensor, loss: str | Callable, beta: float, eps: float) -> Tensor:
    """c_i = dL_i / dQ_T,i [B] of an objective of Q_T alone, detached."""
    return loss_coefficients(lambda q_t: regression_loss(pairs.of_q_terminal(q_t), pairs.target, loss, beta, eps),
                             q_terminal)


def _assembled(terms: SPOTerms) -> Tensor:
    """Each sequence's loss [B]: L_i (or, with a changed coefficient, the value L_i with gradient c_i * grad Q_T,i
    over the tokens not frozen), times scale, plus added."""
    per_sequence = terms.per_sequence
    if terms.surrogate:
        i, coefficient = terms.inputs, terms.coefficient
        pushed_q = terms.q[:, -1]
        if terms.frozen is not None:
            pushed_q = cumulative_q(torch.where(terms.frozen, i.logp.detach(), i.logp), i.ref_logp, i.mask, i.q0,
                                    terms.beta)[:, -1]
        surrogate = coefficient * pushed_q  # gradient: coefficient * grad Q_T (frozen tokens: none); same value
        per_sequence = per_sequence.detach() + (surrogate - surrogate.detach())
    if terms.scale is not None:
        per_sequence = per_sequence * terms.scale
    if terms.added is not None:
        per_sequence = per_sequence + terms.added
    return per_sequence


def _metrics(terms: SPOTerms, total: Tensor) -> dict[str, float]:
    i, beta = terms.inputs, terms.beta
    q_terminal = terms.q[:, -1].detach()
    with torch.no_grad():
        n_tokens = i.mask.to(i.logp.dtype).sum()
        stats = torch.stack(
            [
                total.detach(),
                (q_terminal - i.reward).abs().mean(),
                (token_advantages(i.logp.detach(), i.ref_logp, i.mask, beta).sum() / n_tokens),
                ((q_terminal - i.q0) / beta).mean(),  # q_terminal - q0 = beta * sum_t log(pi / pi_0)
                q_terminal.mean(),
            ]
        ).tolist()  # one sync for all metrics
    metrics = dict(zip(METRIC_NAMES, stats, strict=True))
    if terms.coefficient is not None:  # the size of each sequence's push, as used (centred or not)
        metrics["coefficient_abs"] = float(terms.coefficient.abs().mean())
    return metrics | terms.metrics


@torch.no_grad()
def terminal_coefficients(inputs: SPOInputs, *, beta: float, objective: str, loss: str | Callable,
                          eps: float = 1e-6) -> Tensor:
    """c_i = dL_i / dQ_T,i [B] of a terminal / advantage objective (what the coefficient transforms change),
    detached. The trainer takes prompt-group baselines of these over a whole step (coefficient_baseline)."""
    if objective not in CENTRABLE_OBJECTIVES:
        raise ValueError(f"terminal_coefficients: objective '{objective}' is not a function of Q_T alone "
                         f"(choose from {', '.join(CENTRABLE_OBJECTIVES)})")
    i = _prepared(inputs, inputs.mask if inputs.mask.dtype == torch.bool else inputs.mask != 0)
    q = cumulative_q(i.logp, i.ref_logp, i.mask, i.q0, beta)
    return _coefficient(OBJECTIVE_PAIRS[objective](q, i, beta, "terminal_coefficients"), q[:, -1], loss, beta, eps)


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
