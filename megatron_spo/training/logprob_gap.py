"""The train-vs-rollout log-prob gap: do the engines sample from the trainer's policy?

For every response token of an online sample that carries the engine's log-probs, the trainer's log-prob of
the same token at the same temperature (the engines report log softmax(logits / T) before top-p truncation,
as SGLang does) against the engine's. Logged per step (peers: slime train_rollout_logprob_abs_diff, verl
rollout_probs_diff, prime-rl mismatch_kl):

    logprob_gap/mean_abs     mean over tokens of |log pi_trainer - log pi_engine|
    logprob_gap/max_abs      its largest token
    logprob_gap/mismatch_kl  k3 estimate of KL(engine || trainer), exp(r) - 1 - r with r = log pi_trainer -
                             log pi_engine, mean over tokens of samples drawn with top-p 1 (samples of the
                             engine's distribution at their temperature)
    logprob_gap/sequences    sequences measured
    logprob_gap/current      1 when they are all of the weights the trainer holds now, 0 when none was (the
                             numbers then include legitimate drift of up to model_update_interval steps)

A correct push keeps the gap at the engines' numerical noise (~1e-6 in fp32 on CPU, ~1e-2 in bf16); a broken
weight push, conversion or precision mismatch shows at once as a gap of order 0.1 to 10.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

PREFIX = "logprob_gap/"


@dataclass
class GapTally:
    """Sums over measured response tokens, added over micro-batches and data-parallel ranks."""

    abs_sum: float = 0.0
    tokens: int = 0
    max_abs: float = 0.0
    k3_sum: float = 0.0
    k3_tokens: int = 0
    sequences: int = 0

    def add(self, other: GapTally) -> GapTally:
        return GapTally(self.abs_sum + other.abs_sum, self.tokens + other.tokens, max(self.max_abs, other.max_abs),
                        self.k3_sum + other.k3_sum, self.k3_tokens + other.k3_tokens,
                        self.sequences + other.sequences)

    @property
    def mean_abs(self) -> float:
        return self.abs_sum / self.tokens if self.tokens else math.nan


def measured_rows(batch, current_version: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B] bool masks: the rows to measure (online, with engine log-probs at a known temperature); those of
    them sampled by exactly the weights the trainer holds now (policy_version == current_version; none when
    current_version is None); those sampled with top-p 1 (the mismatch KL's)."""
    temperature = batch.behaviour_temperature
    online = torch.tensor([s == "online" for s in batch.source], dtype=torch.bool, device=temperature.device)
    rows = online & torch.isfinite(temperature)
    current = rows & (batch.policy_version.to(rows.device) == (-1 if current_version is None else current_version))
    return rows, current, rows & (batch.behaviour_top_p == 1.0)


def tally(trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor, loss_mask: torch.Tensor, rows: torch.Tensor,
          kl_rows: torch.Tensor) -> GapTally:
    """The gap over the response tokens (loss_mask [B, L]) of rows [B] bool; the mismatch KL over kl_rows [B].
    trainer_logp, behaviour_logp [B, L]: log-probs of the same tokens at the sample's temperature."""
    mask = loss_mask.bool() & rows[:, None]
    if not bool(mask.any()):
        return GapTally()
    r = trainer_logp.detach().double() - behaviour_logp.to(trainer_logp.device).double()
    diff = r.abs()[mask]
    kl_mask = mask & kl_rows[:, None]
    k3 = torch.expm1(r[kl_mask]) - r[kl_mask]
    return GapTally(float(diff.sum()), int(diff.numel()), float(diff.max()), float(k3.sum()), int(k3.numel()),
                    int(rows.sum()))


@dataclass
class GapPass:
    """The tallies of one step's first policy log-prob pass. version: the policy version the trainer's weights
    are now (None when they have moved since the last push: no sample is then of the current weights)."""

    version: int | None
    current: GapTally = field(default_factory=GapTally)
    every: GapTally = field(default_factory=GapTally)


def gap_metrics(current: GapTally, every: GapTally) -> dict[str, float]:
    """The step's logprob_gap/* metrics: of the current-weights samples when there are any, else of all."""
    t = current if current.tokens else every
    if not t.tokens:
        return {}
    out = {PREFIX + "mean_abs": t.mean_abs, PREFIX + "max_abs": t.max_abs,
           PREFIX + "sequences": float(t.sequences), PREFIX + "current": float(t is current)}
    if t.k3_tokens:
        out[PREFIX + "mismatch_kl"] = t.k3_sum / t.k3_tokens
    return out


def gap_warning(step: int, metrics: dict[str, float], limit: float | None) -> str | None:
    """One line when the current-weights gap exceeds logging.max_logprob_gap, else None (stale samples differ
    legitimately: they never warn)."""
    gap = metrics.get(PREFIX + "mean_abs")
    if limit is None or gap is None or not metrics.get(PREFIX + "current") or gap <= limit:
        return None
    return (f"[megatron-spo] step {step}: engine vs trainer log-prob gap {gap:.3g} per token (max "
            f"{metrics[PREFIX + 'max_abs']:.3g}, {int(metrics[PREFIX + 'sequences'])} samples of the current "
            f"weights) exceeds logging.max_logprob_gap {limit}: the engines do not hold the trainer's policy "
            "(a broken weight push, conversion or precision mismatch)")
