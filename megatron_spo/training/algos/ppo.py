"""PPO with a value model and GAE on KL-regularised token rewards (MATH.md section 5), the paper's baseline."""

from __future__ import annotations

from torch import Tensor

from megatron_spo import algorithms
from megatron_spo.data.batching import TrainBatch
from megatron_spo.training.algos.base import Algorithm, StepInputs, Update


def ppo_advantages(batch: TrainBatch, ref_logp: Tensor, old_values: Tensor, *, beta: float, gamma: float,
                   lam: float) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns [B, L] from the KL-regularised token rewards of the behaviour policy (not yet
    whitened: that is over the whole step, algorithms.whiten_over_batch).

    The KL term uses the behaviour log-probs the engines reported (the policy that produced the tokens).
    """
    token_rewards = algorithms.kl_regularised_token_rewards(batch.reward, batch.behaviour_logp, ref_logp,
                                                            batch.loss_mask, beta=beta)
    advantages, returns = algorithms.gae(token_rewards, old_values, batch.loss_mask, gamma=gamma, lam=lam)
    return advantages.detach(), returns.detach()


def ppo_batch_loss(batch: TrainBatch, logp: Tensor, advantages: Tensor, *, clip_eps: float,
                   ) -> tuple[Tensor, dict[str, float]]:
    return algorithms.ppo_policy_loss(logp, batch.behaviour_logp, advantages, batch.loss_mask, clip_eps=clip_eps)


def value_batch_loss(batch: TrainBatch, values: Tensor, old_values: Tensor, returns: Tensor, *,
                     clip_eps: float | None) -> tuple[Tensor, dict[str, float]]:
    loss = algorithms.ppo_value_loss(values, old_values, returns, batch.loss_mask, clip_eps=clip_eps)
    return loss, {"value_loss": float(loss.detach())}


class PPO(Algorithm):
    name = "ppo"
    uses_value_model = True
    on_policy = True
    uses_behaviour_logprobs = True

    def update(self, step: StepInputs) -> Update:
        cfg = self.cfg
        old_values = step.forward("value", "values")
        adv_ret = [None] * len(step.micro_batches)
        if step.is_last_stage:
            adv_ret = [ppo_advantages(mb, step.ref[i], old_values[i], beta=cfg.beta, gamma=cfg.ppo.gamma,
                                      lam=cfg.ppo.lam) for i, mb in enumerate(step.micro_batches)]
            if cfg.ppo.whiten_advantages:  # over the whole step: every micro-batch, every data-parallel rank
                whitened = algorithms.whiten_over_batch([a for a, _ in adv_ret],
                                                        [mb.loss_mask for mb in step.micro_batches],
                                                        step.sum_across_data_parallel)
                adv_ret = [(a, r) for a, (_, r) in zip(whitened, adv_ret)]
        reports, grad_norm = [], 0.0
        warming_up = step.step <= cfg.ppo.critic_warmup_steps  # the policy waits for a value model worth using
        if not warming_up:
            reports, grad_norm = step.optimize("policy", "logp", lambda i, mb, logp: ppo_batch_loss(
                mb, logp, adv_ret[i][0], clip_eps=cfg.ppo.clip_eps))
        value_reports, value_grad_norm = step.optimize("value", "values", lambda i, mb, v: value_batch_loss(
            mb, v, old_values[i], adv_ret[i][1], clip_eps=cfg.ppo.value_clip_eps))
        return Update(reports + value_reports, grad_norm, {"grad_norm/value": value_grad_norm,
                                                           "critic_warmup": float(warming_up)})
