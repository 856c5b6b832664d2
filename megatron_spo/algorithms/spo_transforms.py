"""SPO's coefficient transforms: small named pieces between the regression loss and its gradient (MATH.md section 7).

For an objective of Q_T alone (terminal, advantage) the gradient of sequence i's loss L_i is c_i * grad Q_T,i, with
the coefficient c_i = dL_i / dQ_T,i (2 (Q_T - r) for squared). A transform is a function SPOTerms -> SPOTerms
(algorithms/spo.py): it may replace the coefficient or freeze tokens it should not reach (terms.replace), scale
each L_i (terms.scaled) or add a term to it (terms.plus). spo_loss applies the transforms in order, then takes
    loss_i = (L_i, or with a changed coefficient the surrogate of value L_i and gradient c_i * grad Q_T,i over the
              tokens not frozen) * scale_i + added_i.
TRANSFORMS holds the built-ins a config lists by name (sources.NAME.transforms); a user's own is any such function,
named in the config as a hook 'package.module:function' (docs/extending-spo.md):

    def doubled(terms):  # twice the push of every sequence
        return terms.replace(coefficient=2 * terms.need_coefficient("doubled"))
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from megatron_spo.algorithms.groups import centred_on_others
from megatron_spo.algorithms.spo import SPOTerms
from megatron_spo.algorithms.validation import upcast


def centre_groups(terms: SPOTerms) -> SPOTerms:
    """c_i - mean_{j in group(i), j != i} c_j over inputs.group (a sequence alone in its group: over all the others,
    groups.centred_on_others). On the samples of a stale or tempered sampler mu the group mean of c drives
    KL(mu || pi) up (MATH.md section 7); centring removes that push, keeps pi* a fixed point (there c is equal
    within a group) and, on-policy, the expected gradient. The reported loss stays the uncentred one."""
    c = terms.need_coefficient("centre_groups")
    group = terms.need_input("centre_groups", "group")
    return _centred_once(terms, "centre_groups").replace(coefficient=centred_on_others(c, group.to(c.device)))


def coefficient_baseline(terms: SPOTerms) -> SPOTerms:
    """c_i - b_i with the baselines b = inputs.coefficient_baseline [B] given: centre_groups's centring with the
    baselines taken over a whole step (training/algos/spo.py step_coefficient_baselines), so micro-batches may
    cut a prompt group."""
    c = terms.need_coefficient("coefficient_baseline")
    baseline = terms.need_input("coefficient_baseline", "coefficient_baseline")
    if baseline.shape != c.shape:
        raise ValueError(f"{terms.where}: coefficient_baseline has shape {tuple(baseline.shape)}, "
                         f"expected {tuple(c.shape)}")
    return _centred_once(terms, "coefficient_baseline").replace(coefficient=c - baseline.to(c).detach())


def coefficient_clip(terms: SPOTerms, *, limit: float) -> SPOTerms:
    """c_i clipped to [-limit, +limit]: a guard for off-policy data (expert text, another model's style) whose pi_0
    log-probs are very low. Their gradient per unit of coefficient is ~16x that of pi_0-style text, and the
    cross-entropy loss gives a success c = -1/beta (11.5 at beta 1/log(1e5)) until Q_T reaches 0, so a few such rows
    steer a whole mixed batch (docs/offpolicy-data.md). The loss value is unchanged; the sign of each push is kept.
    Metric coefficient_clipped: the share of sequences clipped."""
    c = terms.need_coefficient("coefficient_clip")
    if not limit > 0:
        raise ValueError(f"{terms.where}: coefficient_clip needs a limit > 0, got {limit!r}")
    clipped = c.clamp(-limit, limit)
    share = float((clipped != c).to(c.dtype).mean())
    return terms.replace(coefficient=clipped, metrics={**terms.metrics, "coefficient_clipped": share})


def _centred_once(terms: SPOTerms, name: str) -> SPOTerms:
    if terms.centred_by is not None:
        raise ValueError(f"{terms.where}: give centre_groups or coefficient_baseline, not both "
                         f"({terms.centred_by} centred the coefficient already)")
    return terms.replace(centred_by=name)


def trust_region(terms: SPOTerms, *, limit: float) -> SPOTerms:
    """PPO's clip against the sampler mu (inputs.behaviour_logp; rows of zeros are not clipped): a token's gradient
    is dropped once log(pi / mu) has moved past +-limit in the direction its sequence's coefficient pushes it, so
    one batch cannot carry the policy far from the distribution that sampled it. The loss value is unchanged.
    pi and mu are of one distribution: mu = log softmax(logits / T) at the row's sampling temperature T (as the
    engines report it), pi = inputs.sampler_logp, the policy's log-probs at the same T (logp where None: T = 1), so
    the weights that sampled clip nothing. Metric trust_region_clipped: the share of response tokens frozen."""
    c = terms.need_coefficient("trust_region")
    i = terms.inputs
    if i.behaviour_logp is None or not limit > 0:
        raise ValueError(f"{terms.where}: trust_region needs a value > 0 and behaviour_logp (got {limit!r})")
    current = i.logp if i.sampler_logp is None else upcast(i.sampler_logp).to(i.logp.dtype)
    frozen = _outside_trust_region(current, i.behaviour_logp, i.mask, c, limit)
    clipped = float(frozen.sum() / i.mask.to(i.logp.dtype).sum())
    return terms.replace(frozen=frozen if terms.frozen is None else terms.frozen | frozen,
                         metrics={**terms.metrics, "trust_region_clipped": clipped})


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


def token_normalise(terms: SPOTerms) -> SPOTerms:
    """Weigh each sequence's loss by (mean response length / its length): a long response no longer gets a larger
    gradient than a short one (every token's push is the same size); the batch's scale is unchanged and pi*
    (every residual 0) stays the optimum."""
    lengths = terms.inputs.mask.to(terms.inputs.logp.dtype).sum(1)
    return terms.scaled(lengths.mean() / lengths)


def policy_gradient(terms: SPOTerms, *, coef: float) -> SPOTerms:
    """Adds coef * -stopgrad(r_i - b_i) log pi(y_i), b_i the leave-one-out mean reward of its group (inputs.group;
    None: the whole batch), the SPO paper's suggestion. It MOVES the fixed point from pi* towards higher reward
    (the term's gradient at pi* is not zero)."""
    i = terms.inputs
    groups = i.group if i.group is not None else torch.zeros_like(i.reward, dtype=torch.long)
    advantage = centred_on_others(i.reward, groups.to(i.reward.device)).detach()
    seq_logp = torch.where(i.mask, i.logp, torch.zeros((), dtype=i.logp.dtype, device=i.logp.device)).sum(1)
    return terms.plus(-(coef * advantage * seq_logp))


# THE built-in transforms: name -> function(terms, **parameters) -> terms. A config lists them by name in
# sources.NAME.transforms (their parameters come from that source's fields: trust_region's limit from
# trust_region, policy_gradient's coef from pg_coef); a new built-in is one entry here.
TRANSFORMS: dict[str, Callable[..., SPOTerms]] = {
    "centre_groups": centre_groups,
    "coefficient_baseline": coefficient_baseline,
    "coefficient_clip": coefficient_clip,
    "trust_region": trust_region,
    "token_normalise": token_normalise,
    "policy_gradient": policy_gradient,
}
CENTRINGS = ("centre_groups", "coefficient_baseline")  # at most one of them per loss
# the ones that change the coefficient: objectives of Q_T alone only (spo.CENTRABLE_OBJECTIVES)
NEEDS_COEFFICIENT = (*CENTRINGS, "coefficient_clip", "trust_region")


def is_centring(transform: Callable) -> bool:
    return transform is centre_groups or transform is coefficient_baseline


def coefficient_transforms(centre: bool, trust_region_limit: float | None) -> list[Callable]:
    """centre_groups (if centre), then trust_region with this limit (if one): the online source's defaults as the
    drift reproductions (algorithms/tabular.py, recurrent_drift.py) switch them."""
    out = [centre_groups] if centre else []
    if trust_region_limit:
        out.append(lambda terms: trust_region(terms, limit=trust_region_limit))
    return out
