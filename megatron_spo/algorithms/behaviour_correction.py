"""Behaviour correction for stale samples ("decoupled PPO", AReaL; verl's rollout correction TIS / MIS).

Samples come from a behaviour policy mu (the engines, possibly several weight pushes old). The clipped surrogate
takes its ratio against pi_old, the trainer's own policy at the start of the step (recomputed, no grad), and
each token's term is weighted by how much more likely pi_old makes the token than mu, rho_t = pi_old / mu:
    "tis": w_t = min(rho_t, C)                        (truncated importance sampling)
    "mis": w_t = 1 if 1/C <= rho_t <= C else 0        (masked importance sampling: such tokens are dropped)
    "none": w_t = 1
level "sequence" uses one rho per sequence, the geometric mean exp(mean_t log rho_t), for every token of it.
w is a constant of the step (no gradient). With mu == pi_old, rho = 1 and w = 1 exactly.
Shapes: [B, T] per token, mask != 0 on response tokens.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

CORRECTIONS = ("none", "tis", "mis")
LEVELS = ("token", "sequence")


def check_correction(where: str, correction: str, cap: float, level: str) -> None:
    if correction not in CORRECTIONS:
        raise ValueError(f"{where}: unknown behaviour correction '{correction}' (choose from {', '.join(CORRECTIONS)})")
    if level not in LEVELS:
        raise ValueError(f"{where}: unknown correction level '{level}' (choose from {', '.join(LEVELS)})")
    if not cap > 1:
        raise ValueError(f"{where}: the correction cap C must be > 1, got {cap}")


def behaviour_weights(old_logp: Tensor, behaviour_logp: Tensor, valid: Tensor, *, correction: str,
                      cap: float = 2.0, level: str = "token") -> tuple[Tensor, Tensor, Tensor]:
    """(w [B, T] float64, corrected [B, T] bool: truncated (tis) or masked (mis), k3 [B, T]: the per-token
    estimate (rho - 1) - log rho of KL(mu || pi_old) on mu's samples). All detached, 0 / False off ``valid``."""
    check_correction("behaviour_weights", correction, cap, level)
    zero = torch.zeros((), dtype=torch.float64, device=valid.device)
    log_rho = torch.where(valid, old_logp.detach().double() - behaviour_logp.detach().double(), zero)
    k3 = torch.where(valid, torch.expm1(log_rho) - log_rho, zero)
    if level == "sequence":
        per_seq = log_rho.sum(1) / valid.sum(1).clamp(min=1)
        log_rho = torch.where(valid, per_seq.unsqueeze(1).expand_as(log_rho), zero)
    log_cap = math.log(cap)
    if correction == "tis":
        w = log_rho.clamp(max=log_cap).exp()
        corrected = log_rho > log_cap
    elif correction == "mis":
        corrected = log_rho.abs() > log_cap
        w = (~corrected).double()
    else:
        w, corrected = torch.ones_like(log_rho), torch.zeros_like(valid)
    return torch.where(valid, w, zero), corrected & valid, k3


def correction_metrics(w: Tensor, corrected: Tensor, k3: Tensor, valid: Tensor) -> dict[str, float]:
    """Means over the response tokens: behaviour_weight (mean w), behaviour_corrected (share truncated or
    masked), mismatch_kl (k3 estimate of KL(mu || pi_old) per token)."""
    n = max(int(valid.sum()), 1)
    return {"behaviour_weight": float((w * valid).sum()) / n,
            "behaviour_corrected": float(corrected.sum()) / n,
            "mismatch_kl": float((k3 * valid).sum()) / n}
