"""GRPO (algorithms/grpo.py): group-normalised advantages and a clipped ratio against the engines' log-probs.

Micro-batches keep whole prompt groups (the advantages need the group), every log-prob of the step (policy, pi_old,
reference) is the trainer's at each row's sampling temperature (log softmax(logits / T), as the engines report
theirs; verl's and slime's convention), and the loss is normalised over the WHOLE step: sequence_mean divides
by the step's sequences, token_mean by its response tokens, however micro-batches and data-parallel ranks cut
it (the trainer scales each micro-batch loss by n_mb / n_global; this returns the sum over that).
With grpo.behaviour_correction (tis | mis) samples may be stale: the step first recomputes the policy's own
log-probs pi_old (one forward pass), the ratio is taken against them and each token weighted by pi_old / mu
(algorithms/behaviour_correction.py), so weights need not be pushed every step (as slime / AReaL / verl run it).
With grpo.guide_path (mixed-policy GRPO, LUFFY) the sampler splices demonstrations into the online groups (source
'guide', training/sources.py): they share their group's advantages and train through the shaped term; the clip,
KL and correction statistics are of the policy's own samples.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_spo.algorithms.behaviour_correction import correction_metrics
from megatron_spo.algorithms.grpo import aggregate, grpo_advantages, grpo_token_losses
from megatron_spo.data.batching import TrainBatch
from megatron_spo.training.algos.base import Algorithm, StepInputs, Update
from megatron_spo.training.algos.spo import seq_log_ratio_by_source
from megatron_spo.training.sources import GUIDE_SOURCE


def grpo_batch_loss(batch: TrainBatch, logp: Tensor, ref_logp: Tensor, cfg, *, global_sequences: int,
                    global_response_tokens: int, old_logp: Tensor | None = None) -> tuple[Tensor, dict]:
    """old_logp [B, L]: the policy's log-probs at the start of the step (with grpo.behaviour_correction)."""
    g = cfg.grpo
    adv = grpo_advantages(batch.reward, batch.group, scale_rewards=g.scale_rewards).to(logp.device)
    guided = torch.tensor([s == GUIDE_SOURCE for s in batch.source], dtype=torch.bool, device=logp.device)
    per_token, valid, stats = grpo_token_losses(
        logp, batch.behaviour_logp, ref_logp, adv, batch.loss_mask, clip_eps_low=g.clip_eps,
        clip_eps_high=g.clip_eps_high or g.clip_eps, beta=cfg.beta, old_logp=old_logp,
        correction=g.behaviour_correction, correction_cap=g.correction_cap, correction_level=g.correction_level,
        guided=guided if bool(guided.any()) else None, shaping_gamma=g.guide_shaping)
    total, _ = aggregate(per_token, valid, g.aggregation)
    n_mb = batch.num_sequences
    normaliser = global_sequences if g.aggregation == "sequence_mean" else global_response_tokens
    # the trainer weighs this micro-batch by n_mb / n_global: undo that, so the step's loss is sum / normaliser
    loss = total * (global_sequences / (n_mb * normaliser))
    own = valid & ~guided.unsqueeze(1)  # the policy's own samples: what the clip, KL and correction stats are of
    tokens, own_tokens = int(valid.sum()), int(own.sum())
    metrics: dict = {"loss": float(total.detach()) / max(1, n_mb if g.aggregation == "sequence_mean" else tokens),
                     "clip_fraction": (float(stats["clipped"].sum()) / max(own_tokens, 1), own_tokens),
                     "approx_kl_old_new": (float((stats["approx_kl_old_new"] * own).sum()) / max(own_tokens, 1),
                                           own_tokens),
                     "advantage_abs": float(adv.abs().mean())}
    if "kl_ref" in stats:
        metrics["kl_ref_k3"] = (float((stats["kl_ref"] * own).sum()) / max(own_tokens, 1), own_tokens)
    if "behaviour_weight" in stats:
        corrected = correction_metrics(stats["behaviour_weight"], stats["behaviour_corrected"],
                                       stats["mismatch_k3"], own)
        metrics.update({k: (v, own_tokens) for k, v in corrected.items()})
    if g.guide_path:  # mixed-policy GRPO: how many demonstrations, their advantage and shaped probabilities
        demo_tokens = tokens - own_tokens
        n_demo = int(guided.sum())
        metrics["guide_share"] = n_demo / n_mb  # of the step's sequences
        if n_demo:
            metrics["guide_advantage"] = (float(adv[guided].mean()), n_demo)
            metrics["guide_shaped_p"] = (float(stats["shaped_p"].sum()) / max(demo_tokens, 1), demo_tokens)
    by_source = seq_log_ratio_by_source(batch, logp, ref_logp)
    metrics.update(by_source)
    metrics["mean_seq_log_ratio"] = sum(v * n for v, n in by_source.values()) / batch.num_sequences
    return loss, metrics


class GRPO(Algorithm):
    name = "grpo"
    keeps_prompt_groups = True
    on_policy = True
    uses_behaviour_logprobs = True
    default_beta = 0.0  # TRL's GRPOTrainer default: no KL term (and no reference forward needed for it)

    @classmethod
    def required_update_interval(cls, cfg) -> int | None:
        """Every step, unless the behaviour correction makes stale samples usable."""
        return None if cfg.grpo.behaviour_correction != "none" else 1

    def update(self, step: StepInputs) -> Update:
        old = [None] * len(step.micro_batches)
        if self.cfg.grpo.behaviour_correction != "none":
            old = step.forward("policy", "logp")
        reports, grad_norm = step.optimize("policy", "logp", lambda i, mb, logp: grpo_batch_loss(
            mb, logp, step.ref[i], self.cfg, global_sequences=step.global_sequences,
            global_response_tokens=step.global_response_tokens, old_logp=old[i]))
        return Update(reports, grad_norm)
