"""GRPO (algorithms/grpo.py): group-normalised advantages and a clipped ratio against the engines' log-probs.

Micro-batches keep whole prompt groups (the advantages need the group), the behaviour log-probs must be of the
sampling distribution (T = 1, top-p 1), and the loss is normalised over the WHOLE step: sequence_mean divides
by the step's sequences, token_mean by its response tokens, however micro-batches and data-parallel ranks cut
it (the trainer scales each micro-batch loss by n_mb / n_global; this returns the sum over that).
"""

from __future__ import annotations

from torch import Tensor

from megatron_spo.algorithms.grpo import aggregate, grpo_advantages, grpo_token_losses
from megatron_spo.data.batching import TrainBatch
from megatron_spo.training.algos.base import Algorithm, StepInputs, Update
from megatron_spo.training.algos.spo import seq_log_ratio_by_source


def grpo_batch_loss(batch: TrainBatch, logp: Tensor, ref_logp: Tensor, cfg, *, global_sequences: int,
                    global_response_tokens: int) -> tuple[Tensor, dict]:
    g = cfg.grpo
    adv = grpo_advantages(batch.reward, batch.group, scale_rewards=g.scale_rewards).to(logp.device)
    per_token, valid, stats = grpo_token_losses(
        logp, batch.behaviour_logp, ref_logp, adv, batch.loss_mask, clip_eps_low=g.clip_eps,
        clip_eps_high=g.clip_eps_high or g.clip_eps, kl_coef=g.kl_coef)
    total, _ = aggregate(per_token, valid, g.aggregation)
    n_mb = batch.num_sequences
    normaliser = global_sequences if g.aggregation == "sequence_mean" else global_response_tokens
    # the trainer weighs this micro-batch by n_mb / n_global: undo that, so the step's loss is sum / normaliser
    loss = total * (global_sequences / (n_mb * normaliser))
    tokens = int(valid.sum())
    metrics: dict = {"loss": float(total.detach()) / max(1, n_mb if g.aggregation == "sequence_mean" else tokens),
                     "clip_fraction": (float(stats["clipped"].sum()) / max(tokens, 1), tokens),
                     "approx_kl_old_new": (float((stats["approx_kl_old_new"] * valid).sum()) / max(tokens, 1), tokens),
                     "advantage_abs": float(adv.abs().mean())}
    if "kl_ref" in stats:
        metrics["kl_ref_k3"] = (float((stats["kl_ref"] * valid).sum()) / max(tokens, 1), tokens)
    by_source = seq_log_ratio_by_source(batch, logp, ref_logp)
    metrics.update(by_source)
    metrics["mean_seq_log_ratio"] = sum(v * n for v, n in by_source.values()) / batch.num_sequences
    return loss, metrics


class GRPO(Algorithm):
    name = "grpo"
    keeps_prompt_groups = True
    on_policy = True
    uses_behaviour_logprobs = True

    def update(self, step: StepInputs) -> Update:
        reports, grad_norm = step.optimize("policy", "logp", lambda i, mb, logp: grpo_batch_loss(
            mb, logp, step.ref[i], self.cfg, global_sequences=step.global_sequences,
            global_response_tokens=step.global_response_tokens))
        return Update(reports, grad_norm)
