"""PPO with a value model and GAE on KL-regularised token rewards (MATH.md section 5), the paper's baseline.

With ppo.behaviour_correction (tis | mis) samples may be stale: the step recomputes the policy's log-probs pi_old
(one forward pass); the ratio is against them, each token is weighted by pi_old / mu (algorithms/
behaviour_correction.py) and the KL penalty of the token rewards is pi_old's (the policy being trained, as verl),
not the engines'. Weights then need not be pushed every step."""

from __future__ import annotations

from torch import Tensor

from megatron_spo import algorithms
from megatron_spo.data.batching import TrainBatch
from megatron_spo.training.algos.base import Algorithm, StepInputs, Update


def ppo_advantages(batch: TrainBatch, ref_logp: Tensor, old_values: Tensor, *, beta: float, gamma: float,
                   lam: float, old_logp: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns [B, L] from the KL-regularised token rewards of the behaviour policy (not yet
    whitened: that is over the whole step, algorithms.whiten_over_batch).

    The KL term uses the behaviour log-probs the engines reported (the policy that produced the tokens), or
    old_logp, the policy's own at the start of the step, where given (behaviour correction).
    """
    logp = batch.behaviour_logp if old_logp is None else old_logp
    token_rewards = algorithms.kl_regularised_token_rewards(batch.reward, logp, ref_logp, batch.loss_mask, beta=beta)
    advantages, returns = algorithms.gae(token_rewards, old_values, batch.loss_mask, gamma=gamma, lam=lam)
    return advantages.detach(), returns.detach()


def ppo_batch_loss(batch: TrainBatch, logp: Tensor, advantages: Tensor, *, clip_eps: float,
                   old_logp: Tensor | None = None, correction: str = "none", correction_cap: float = 2.0,
                   correction_level: str = "token") -> tuple[Tensor, dict[str, float]]:
    return algorithms.ppo_policy_loss(logp, batch.behaviour_logp, advantages, batch.loss_mask, clip_eps=clip_eps,
                                      old_logp=old_logp, correction=correction, correction_cap=correction_cap,
                                      correction_level=correction_level)


def value_batch_loss(batch: TrainBatch, values: Tensor, old_values: Tensor, returns: Tensor, *,
                     clip_eps: float | None) -> tuple[Tensor, dict[str, float]]:
    loss = algorithms.ppo_value_loss(values, old_values, returns, batch.loss_mask, clip_eps=clip_eps)
    return loss, {"value_loss": float(loss.detach())}


class PPO(Algorithm):
    name = "ppo"
    uses_value_model = True
    on_policy = True
    uses_behaviour_logprobs = True

    @classmethod
    def required_update_interval(cls, cfg) -> int | None:
        """Every step, unless the behaviour correction makes stale samples usable."""
        return None if cfg.ppo.behaviour_correction != "none" else 1

    def update(self, step: StepInputs) -> Update:
        cfg, p = self.cfg, self.cfg.ppo
        old_values = step.forward("value", "values")
        old = [None] * len(step.micro_batches)
        if p.behaviour_correction != "none":
            old = step.forward("policy", "logp")
        adv_ret = [None] * len(step.micro_batches)
        if step.is_last_stage:
            adv_ret = [ppo_advantages(mb, step.ref[i], old_values[i], beta=cfg.beta, gamma=p.gamma, lam=p.lam,
                                      old_logp=old[i]) for i, mb in enumerate(step.micro_batches)]
            if cfg.ppo.whiten_advantages:  # over the whole step: every micro-batch, every data-parallel rank
                whitened = algorithms.whiten_over_batch([a for a, _ in adv_ret],
                                                        [mb.loss_mask for mb in step.micro_batches],
                                                        step.sum_across_data_parallel)
                adv_ret = [(a, r) for a, (_, r) in zip(whitened, adv_ret)]
        reports, grad_norm = [], 0.0
        warming_up = step.step <= cfg.ppo.critic_warmup_steps  # the policy waits for a value model worth using
        if not warming_up:
            reports, grad_norm = step.optimize("policy", "logp", lambda i, mb, logp: ppo_batch_loss(
                mb, logp, adv_ret[i][0], clip_eps=p.clip_eps, old_logp=old[i], correction=p.behaviour_correction,
                correction_cap=p.correction_cap, correction_level=p.correction_level))
        value_reports, value_grad_norm = step.optimize("value", "values", lambda i, mb, v: value_batch_loss(
            mb, v, old_values[i], adv_ret[i][1], clip_eps=cfg.ppo.value_clip_eps))
        return Update(reports + value_reports, grad_norm, {"grad_norm/value": value_grad_norm,
                                                           "critic_warmup": float(warming_up)})
