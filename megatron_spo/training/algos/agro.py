"""AGRO (MATH.md section 4): leave-one-out over the samples of a prompt, so micro-batches keep whole groups."""

from __future__ import annotations

from torch import Tensor

from megatron_spo import algorithms
from megatron_spo.data.batching import TrainBatch
from megatron_spo.training.algos.base import Algorithm, StepInputs, Update
from megatron_spo.training.algos.spo import seq_log_ratio_by_source


def agro_batch_loss(batch: TrainBatch, logp: Tensor, ref_logp: Tensor, *, beta: float,
                    on_policy: bool) -> tuple[Tensor, dict[str, float | tuple[float, int]]]:
    loss, metrics = algorithms.agro_loss(logp, ref_logp, batch.loss_mask, batch.reward, batch.group, beta=beta,
                                         on_policy=on_policy)
    metrics.update(seq_log_ratio_by_source(batch, logp, ref_logp))
    return loss, metrics


class AGRO(Algorithm):
    name = "agro"
    keeps_prompt_groups = True

    def update(self, step: StepInputs) -> Update:
        beta, on_policy = self.cfg.beta, self.cfg.agro.on_policy
        reports, grad_norm = step.optimize("policy", "logp", lambda i, mb, logp: agro_batch_loss(
            mb, logp, step.ref[i], beta=beta, on_policy=on_policy))
        return Update(reports, grad_norm)
