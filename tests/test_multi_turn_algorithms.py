"""The environment's tokens of a multi-turn response (mask 0 between model turns, issue 63) get exactly zero gradient
and contribute nothing to SPO's Q_t, AGRO's sequence terms, GRPO's and PPO's losses: changing their log-probs
changes nothing; the model's tokens around them train as usual."""

import torch

from megatron_spo import algorithms
from megatron_spo.algorithms.grpo import aggregate, grpo_token_losses
from megatron_spo.algorithms.spo_transforms import centre_groups, trust_region

D = torch.float64
MASK = torch.tensor([[0, 1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0, 1], [0, 1, 0, 0, 0, 1, 1]],
                    dtype=torch.bool)
ENV = torch.tensor([[0, 0, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0]],
                   dtype=torch.bool)  # inside the response, mask 0: the observations


def _inputs(seed: int, env_shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(4, 7, generator=g, dtype=D) * 3
    ref = -torch.rand(4, 7, generator=g, dtype=D) * 3
    behaviour = -torch.rand(4, 7, generator=g, dtype=D) * 3
    # what the environment's tokens hold makes no difference: shift them
    logp, ref, behaviour = (x + env_shift * ENV for x in (logp, ref, behaviour))
    return logp.requires_grad_(), ref, behaviour


REWARD = torch.tensor([0.0, -1.0, -1.0, 0.0], dtype=D)
GROUP = torch.tensor([0, 0, 1, 1])


def _losses(logp, ref, behaviour):
    spo, _ = algorithms.spo_loss(
        algorithms.SPOInputs(logp, ref, MASK, REWARD, torch.full((4,), -0.3, dtype=D), group=GROUP,
                             behaviour_logp=behaviour),
        beta=0.5, objective="terminal", loss="squared",
        transforms=(centre_groups, lambda t: trust_region(t, limit=0.2)))
    reverse, _ = algorithms.spo_loss(algorithms.SPOInputs(logp, ref, MASK, REWARD, torch.full((4,), -0.3, dtype=D)),
                                     beta=0.5, objective="reverse_q", loss="cross_entropy")
    agro, _ = algorithms.agro_loss(logp, ref, MASK, REWARD, GROUP, beta=0.5, on_policy=False)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=D)
    per_token, valid, _ = grpo_token_losses(logp, behaviour, ref, adv, MASK, clip_eps_low=0.2, clip_eps_high=0.2,
                                            beta=0.1)
    grpo = aggregate(per_token, valid, "token_mean")[0]
    ppo, _ = algorithms.ppo_policy_loss(logp, behaviour, adv[:, None].expand(4, 7) * MASK, MASK, clip_eps=0.2)
    return {"spo": spo, "spo reverse_q": reverse, "agro": agro, "grpo": grpo, "ppo": ppo}


def test_environment_tokens_get_zero_gradient_and_change_no_loss():
    base, shifted = _losses(*_inputs(1)), _losses(*_inputs(1, env_shift=-2.5))
    for name, loss in base.items():
        logp = _inputs(1)[0]
        (grad,) = torch.autograd.grad(_losses(logp, *_inputs(1)[1:])[name], logp)
        assert torch.equal(grad[ENV], torch.zeros_like(grad[ENV])), name  # exactly zero
        assert bool((grad[MASK] != 0).any()), name  # the model's tokens do train
        assert float(shifted[name].detach()) == float(loss.detach()), name  # their log-probs change nothing


def test_q_t_accumulates_over_the_models_tokens_only():
    logp, ref, _ = _inputs(2)
    q = algorithms.cumulative_q(logp, ref, MASK, torch.full((4,), -0.3, dtype=D), 0.5)
    expect = -0.3 + 0.5 * torch.cumsum(torch.where(MASK, logp - ref, torch.zeros((), dtype=D)), dim=1)
    torch.testing.assert_close(q[MASK], expect[MASK], rtol=0, atol=1e-12)
    # through an observation Q holds the last model token's value (the environment adds no advantage)
    for b, t in ENV.nonzero().tolist():
        assert float(q[b, t]) == float(q[b, t - 1])
    shifted_logp, shifted_ref, _ = _inputs(2, env_shift=-4.0)
    assert torch.equal(algorithms.cumulative_q(shifted_logp, shifted_ref, MASK, torch.full((4,), -0.3, dtype=D), 0.5),
                       q)
