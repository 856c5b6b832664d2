"""Keeping a run stable: the learning-rate schedule and the divergence guard.

The guard watches two things each step: the mean sequence log(pi / pi_0) (a collapse already under way) and, for
SPO, the signed mean residual Q_T - r of each source. The residual is the early signal: on a sampler mu its mean
pushes pi away from mu and grows with KL(pi || pi*) (MATH.md section 7), so it rises tens of steps before the
log-ratio runs away.
"""

from __future__ import annotations

import math


class TrainingDiverged(RuntimeError):
    """The run is collapsing: the message says which signal fired, at which step, and what to change."""


def lr_at(step: int, base: float, *, warmup_steps: int, total_steps: int, decay: str = "constant",
          min_lr_fraction: float = 0.1) -> float:
    """Learning rate at 1-based `step`: linear warm-up over warmup_steps, then constant (the paper's) or a
    linear / cosine decay reaching base * min_lr_fraction at total_steps."""
    if warmup_steps > 0 and step < warmup_steps:
        return base * step / warmup_steps
    if decay == "constant":
        return base
    if decay not in ("linear", "cosine"):
        raise ValueError(f"optimizer.decay: unknown schedule '{decay}' (constant | linear | cosine)")
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return base * (min_lr_fraction + (1.0 - min_lr_fraction) * shape)


class DivergenceGuard:
    """Raises TrainingDiverged when the log-ratio passes max_log_ratio, or when, for `patience` consecutive steps, a
    source's signed mean residual (metric residual_mean/SOURCE) stays above max_residual or its root-mean-square
    residual (sqrt of residual_sq/SOURCE) above max_residual_rms. Rewards and Q0 lie in [-1, 0], so an RMS residual
    above 1 means Q_T has left the reward range: on the quickstart task the uncentred online-only run's RMS went
    0.4 -> 2.3 while its signed mean kept changing sign (the samples' KL(mu || pi) pulls that mean down)."""

    def __init__(self, max_log_ratio: float | None, max_residual: float | None, patience: int,
                 max_residual_rms: float | None = None):
        self.max_log_ratio, self.max_residual, self.patience = max_log_ratio, max_residual, patience
        self.max_residual_rms = max_residual_rms
        self.over: dict[tuple[str, str], int] = {}  # (signal, source) -> consecutive steps over its limit

    def check(self, step: int, metrics: dict[str, float]) -> None:
        ratio = metrics.get("mean_seq_log_ratio", 0.0)
        if self.max_log_ratio is not None and abs(ratio) > self.max_log_ratio:
            raise TrainingDiverged(f"step {step}: mean sequence log(pi/pi_0) = {ratio:.3g} exceeds "
                                   f"logging.max_log_ratio {self.max_log_ratio}: the policy is collapsing (lower "
                                   "the LR, raise beta, or mix in offline data)")
        signals = (("residual_mean/", "mean", self.max_residual, "logging.max_residual", lambda v: v),
                   ("residual_sq/", "root-mean-square", self.max_residual_rms, "logging.max_residual_rms",
                    lambda v: math.sqrt(max(v, 0.0))))
        for prefix, what, limit, field, value_of in signals:
            if limit is None:
                continue
            for key, raw in sorted(metrics.items()):
                if not key.startswith(prefix):
                    continue
                source, value = key.split("/", 1)[1], value_of(raw)
                count = self.over.get((prefix, source), 0) + 1 if value > limit else 0
                self.over[(prefix, source)] = count
                if count >= self.patience:
                    raise TrainingDiverged(
                        f"step {step}: the {what} residual Q_T - r on source '{source}' has stayed above {field} "
                        f"{limit} for {self.patience} steps (now {value:.3g}): SPO is drifting off its own samples "
                        f"(docs/spo-stability.md); train with sources.{source}.centre=true and a "
                        f"sources.{source}.trust_region (0.2), a lower LR or fresher samples (a smaller "
                        "model_update_interval), and check the Q0 estimates")
