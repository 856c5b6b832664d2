"""What one training step logs, assembled from what the step did (the trainer's step only hands over the parts).

Every value is a float; names are the ones metrics.jsonl, wandb and the plot panels (training/metrics.py) use.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from megatron_spo.memory import peak_rss_gb
from megatron_spo.training.config import GUIDE_SOURCE


@dataclass(frozen=True)
class StepTimes:
    """Seconds spent by one step: waiting for rollouts, reference + update, pushing weights, and in all."""

    rollout_wait: float
    forward_backward: float
    weight_sync: float
    step: float


def trajectory_metrics(trajs: list, policy_version: int) -> dict[str, float]:
    """Mean reward, each source's share of the batch (when it mixes several), and for online samples their
    reward, count and staleness (policy versions behind)."""
    metrics = {"reward": sum(t.reward for t in trajs) / len(trajs)}
    counts = Counter(t.source for t in trajs if t.source != GUIDE_SOURCE)  # the guide's: GRPO's guide_share
    if len(counts) > 1:  # the mix the sources' weights (and their schedules) gave this step
        metrics.update({f"batch_share/{name}": n / len(trajs) for name, n in counts.items()})
    online = [t for t in trajs if t.source == "online"]
    if online:  # offline data has no meaningful version
        versions = [t.policy_version for t in online]
        metrics["staleness"] = policy_version - sum(versions) / len(versions)
        metrics["staleness/max"] = float(policy_version - min(versions))
        metrics["reward/online"] = sum(t.reward for t in online) / len(online)
        metrics["samples/online"] = float(len(online))  # rollouts consumed: learning curves per rollout
    return metrics


def step_metrics(trajs: list, *, loss: dict, fleet: dict, update: dict, evaluation: dict, times: StepTimes,
                 lr: float, grad_norm: float, policy_version: int, pad_share: float,
                 reference_step: int | None) -> dict[str, float]:
    """One step's metrics line. loss: the algorithm's reduced loss metrics (and the log-prob gap); fleet: the
    rollout fleet's and the last weight push's statistics (rank 0); update: the algorithm's step-wide metrics;
    evaluation: held-out pass@k when it ran; reference_step: the step the reference was copied from (None
    without reference refresh)."""
    batch = trajectory_metrics(trajs, policy_version)
    metrics = {**loss, **fleet}
    metrics.update({
        "lr": lr, "grad_norm": grad_norm, "reward": batch.pop("reward"), "time/rollout_wait": times.rollout_wait,
        "time/forward_backward": times.forward_backward, "time/weight_sync": times.weight_sync,
        "time/step": times.step, "policy_version": float(policy_version), "memory/peak_rss_gb": peak_rss_gb(),
        "batch/pad_share": pad_share,
    })
    metrics.update(batch)
    metrics.update(update)
    metrics.update(evaluation)
    if reference_step is not None:
        metrics["reference_step"] = float(reference_step)
    metrics["tokens_per_s"] = sum(len(t.response_tokens) for t in trajs) / max(times.step, 1e-9)
    if "mean_seq_log_ratio/online" in metrics:
        # the k1 estimate of KL(pi || pi_0) is this mean on samples from pi itself: online trajectories only
        # (offline data such as pi_0's own samples gives -KL(pi_0 || pi)); still biased when the engines
        # sample below T=1 (rollout.temperature_range) or from a stale policy
        metrics["kl"] = metrics["mean_seq_log_ratio/online"]
    return metrics
