"""The trainer's loss for one micro-batch: SPO per data source, AGRO, or PPO, from token log-probs.

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

from collections import defaultdict

import torch
from torch import Tensor

from megatron_spo import algorithms
from megatron_spo.algorithms.agro import sequence_logp
from megatron_spo.algorithms.validation import upcast
from megatron_spo.data.batching import TrainBatch


def microbatch_scale(n_mb: int, num_microbatches: int, dp_size: int, n_global: int) -> float:
    return n_mb * num_microbatches * dp_size / n_global


def _rows(batch: TrainBatch, rows: list[int], *tensors: Tensor | None) -> list[Tensor | None]:
    idx = torch.tensor(rows, dtype=torch.long, device=batch.loss_mask.device)
    return [None if t is None else t.index_select(0, idx) for t in tensors]


def _by_source(batch: TrainBatch) -> dict[str, list[int]]:
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(batch.source):
        by_source[s].append(i)
    return dict(sorted(by_source.items()))


def spo_batch_loss(batch: TrainBatch, logp: Tensor, ref_logp: Tensor, *, beta: float,
                   objectives: dict[str, tuple[str, str]]) -> tuple[Tensor, dict[str, float]]:
    """Mean over sequences of spo_loss, each source with its own (objective, loss).

    objectives: source name -> (objective, loss), e.g. {"online": ("terminal", "cross_entropy"),
    "mc": ("mc", "cross_entropy")}. A source in the batch with no entry is an error naming it.
    """
    total = logp.new_zeros(())
    metrics: dict[str, float | tuple[float, int]] = {}
    n = batch.num_sequences
    by_source = _by_source(batch)
    for source, rows in by_source.items():
        if source not in objectives:
            raise ValueError(f"spo: the batch has trajectories of source '{source}' but the config names no "
                             f"objective for it (configured: {', '.join(sorted(objectives))})")
        objective, loss_name = objectives[source]
        lp, rlp, mask, reward, q0, mc_pos, mc_succ = _rows(
            batch, rows, logp, ref_logp, batch.loss_mask, batch.reward, batch.q0, batch.mc_positions,
            batch.mc_success)
        kw = {}
        if objective == "mc":
            kw = dict(mc_positions=mc_pos, mc_success=mc_succ)
        loss, m = algorithms.spo_loss(lp, rlp, mask, reward, q0, beta=beta, objective=objective,
                                      loss=loss_name, **kw)
        total = total + loss * (len(rows) / n)
        weights = {k: len(rows) for k in m}
        weights["mean_token_advantage"] = int(mask.sum())  # a mean over response tokens
        for k, v in m.items():
            metrics[f"{k}/{source}"] = (v, weights[k])
    for k in algorithms.spo.METRIC_NAMES:  # over sources, with the same weights
        parts = [metrics[f"{k}/{source}"] for source in by_source]
        weight = sum(w for _, w in parts)
        metrics[k] = (sum(v * w for v, w in parts) / max(weight, 1), weight)
    metrics["loss"] = float(total.detach())
    return total, metrics


def agro_batch_loss(batch: TrainBatch, logp: Tensor, ref_logp: Tensor, *, beta: float,
                    on_policy: bool) -> tuple[Tensor, dict[str, float | tuple[float, int]]]:
    loss, metrics = algorithms.agro_loss(logp, ref_logp, batch.loss_mask, batch.reward, batch.group, beta=beta,
                                         on_policy=on_policy)
    seq_log_ratio = sequence_logp(upcast(logp.detach()) - upcast(ref_logp), batch.loss_mask.bool())
    for source, rows in _by_source(batch).items():
        metrics[f"mean_seq_log_ratio/{source}"] = (float(seq_log_ratio[rows].mean()), len(rows))
    return loss, metrics


def ppo_advantages(batch: TrainBatch, ref_logp: Tensor, old_values: Tensor, *, beta: float, gamma: float,
                   lam: float, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns [B, L] from the KL-regularised token rewards of the behaviour policy.

    The KL term uses the behaviour log-probs the engines reported (the policy that produced the tokens).
    """
    mask = batch.loss_mask
    token_rewards = algorithms.kl_regularised_token_rewards(batch.reward, batch.behaviour_logp, ref_logp, mask,
                                                            beta=beta)
    advantages, returns = algorithms.gae(token_rewards, old_values, mask, gamma=gamma, lam=lam)
    if whiten:
        valid = mask.bool()
        mean = advantages[valid].mean()
        std = advantages[valid].std(unbiased=False).clamp(min=1e-6)
        advantages = torch.where(valid, (advantages - mean) / std, torch.zeros_like(advantages))
    return advantages.detach(), returns.detach()


def ppo_batch_loss(batch: TrainBatch, logp: Tensor, advantages: Tensor, *, clip_eps: float,
                   ) -> tuple[Tensor, dict[str, float]]:
    return algorithms.ppo_policy_loss(logp, batch.behaviour_logp, advantages, batch.loss_mask, clip_eps=clip_eps)


def value_batch_loss(batch: TrainBatch, values: Tensor, old_values: Tensor, returns: Tensor, *,
                     clip_eps: float | None) -> tuple[Tensor, dict[str, float]]:
    loss = algorithms.ppo_value_loss(values, old_values, returns, batch.loss_mask, clip_eps=clip_eps)
    return loss, {"value_loss": float(loss.detach())}


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
