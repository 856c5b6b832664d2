"""What every algorithm's micro-batch loss shares: its weighting in the global batch and the metric reductions.
(The losses themselves: training/algos/, one module per algorithm.)

Inputs are the shifted [B, L] layout of data/batching.py: logp / ref_logp / values at every position,
batch.loss_mask = 1 where the target is a response token.

Micro-batch weighting: the gradient of a step must be the mean over ALL sequences of the global batch,
however a token budget split them. Megatron's schedules divide each micro-batch loss by the number of
micro-batches and DDP averages over data-parallel ranks, so each micro-batch loss is scaled by
    n_mb * num_microbatches * dp_size / n_global
which turns their sum into sum_mb n_mb * mean_mb / n_global = the global mean.

Metrics: a float is a mean over the micro-batch's sequences; a (mean, weight) pair is a mean over `weight`
sequences or tokens (a per-source metric such as "loss/offline", a per-token one), so metric_sums weights it
by that when the trainer averages micro-batches and data-parallel ranks: the result is the global batch's.
"""

from __future__ import annotations

from torch import Tensor


def microbatch_scale(n_mb: int, num_microbatches: int, dp_size: int, n_global: int) -> float:
    return n_mb * num_microbatches * dp_size / n_global


def metric_sums(store: list[dict]) -> dict[str, list[float]]:
    """{name: [weighted sum, total weight]} over micro-batch results {"metrics": {...}, "n": sequences}: a
    float metric weighs its micro-batch's sequence count, a (mean, weight) pair its own weight. Sums from
    several ranks add; sum / weight is the global batch's metric."""
    out: dict[str, list[float]] = {}
    for item in store:
        for k, v in item["metrics"].items():
            v, w = v if isinstance(v, tuple) else (v, item["n"])
            acc = out.setdefault(k, [0.0, 0.0])
            acc[0] += v * w
            acc[1] += w
    return out


def mean_sequence_entropy(entropy: Tensor, loss_mask: Tensor) -> float:
    """Mean over sequences of each sequence's mean per-token entropy (nats) on its response tokens.

    entropy, loss_mask [B, L]; a sequence with no response token counts as 0. Sequence-weighted like the
    loss metrics, so the trainer's reduction over micro-batches and data-parallel ranks stays exact.
    """
    mask = loss_mask.to(entropy.dtype)
    per_sequence = (entropy.detach() * mask).sum(1) / mask.sum(1).clamp(min=1)
    return float(per_sequence.mean())
