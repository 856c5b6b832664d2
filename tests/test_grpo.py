"""GRPO's math (algorithms/grpo.py): exact advantages and gradients, clipping, the k3 KL, both aggregations,
convergence on a bandit; and the config refusing behaviour log-probs of another distribution."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_spo.algorithms.grpo import aggregate, grpo_advantages, grpo_token_losses


def test_group_normalised_advantages_exact():
    reward = torch.tensor([0.0, -1.0, -1.0, 0.0, -1.0, 0.5])
    group = torch.tensor([0, 0, 0, 0, 1, 2])  # group 1 and 2 have one sample: nothing to compare with
    adv = grpo_advantages(reward, group)
    r = torch.tensor([0.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    want = (r - r.mean()) / (r.std() + 1e-4)  # torch.std: unbiased, as TRL
    torch.testing.assert_close(adv[:4], want.float())
    assert adv[4:].tolist() == [0.0, 0.0]
    assert grpo_advantages(reward, group, scale_rewards=False)[:4].tolist() == [0.5, -0.5, -0.5, 0.5]
    assert grpo_advantages(torch.zeros(4), torch.zeros(4, dtype=torch.long)).abs().max() == 0  # all equal: 0


def _tokens(seed=0, b=3, t=5):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g) * 3
    mask = torch.ones(b, t)
    mask[0, :2] = 0  # prompt positions
    mask[2, 4:] = 0  # padding
    return logp, mask


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_on_policy_gradient_is_minus_advantage_over_the_normaliser(aggregation):
    logp, mask = _tokens()
    adv = torch.tensor([1.5, -0.5, 0.25])
    x = logp.clone().requires_grad_(True)
    per_token, valid, _ = grpo_token_losses(x, logp, None, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, beta=0.0)
    total, norm = aggregate(per_token, valid, aggregation)
    (total / norm).backward()
    n_tokens = mask.sum(1, keepdim=True)
    denom = mask.sum() if aggregation == "token_mean" else n_tokens * mask.shape[0]
    want = -adv.unsqueeze(1) * mask / denom  # d(rho)/d(logp) = rho = 1 on-policy
    torch.testing.assert_close(x.grad, want)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    logp, mask = _tokens()
    behaviour = logp - 0.5  # ratio e^0.5 = 1.65 > 1 + 0.2
    x = logp.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 1.0])
    per_token, valid, stats = grpo_token_losses(x, behaviour, None, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                                                beta=0.0)
    per_token.sum().backward()
    # positive advantage above 1 + eps: clipped, no gradient; negative advantage: min picks the unclipped term
    assert x.grad[0].abs().sum() == 0 and x.grad[2].abs().sum() == 0
    torch.testing.assert_close(x.grad[1], math.exp(0.5) * mask[1])
    assert stats["clipped"].sum() == valid.sum()
    # DAPO's clip-higher: with eps_high = 1.0 the same ratio is inside the region again
    x.grad = None
    per_token, _, _ = grpo_token_losses(x, behaviour, None, adv, mask, clip_eps_low=0.2, clip_eps_high=1.0, beta=0.0)
    per_token.sum().backward()
    torch.testing.assert_close(x.grad[0], -math.exp(0.5) * mask[0])


def test_k3_kl_penalty_is_exact_and_nonnegative():
    logp, mask = _tokens()
    ref = logp + torch.linspace(-1, 1, logp.numel()).view_as(logp)
    adv = torch.zeros(3)
    per_token, valid, stats = grpo_token_losses(logp, logp, ref, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2,
                                                beta=0.1)
    d = ref - logp
    k3 = (d.exp() - d - 1) * mask
    torch.testing.assert_close(per_token, 0.1 * k3)
    assert (stats["kl_ref"] >= 0).all()
    same, _, _ = grpo_token_losses(logp, logp, logp, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, beta=1.0)
    assert same.abs().max() == 0


def test_grpo_learns_the_best_arm_of_a_bandit():
    """Softmax policy over 4 arms, rewards 0 for arm 2 and -1 otherwise, groups of 8 samples of one prompt:
    on-policy GRPO steps take P(arm 2) from 0.25 to > 0.95."""
    torch.manual_seed(0)
    logits = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)
    reward_of = torch.tensor([-1.0, -1.0, 0.0, -1.0])
    for _ in range(150):
        probs = torch.softmax(logits, 0)
        arms = torch.multinomial(probs.detach(), 8, replacement=True)
        logp = torch.log_softmax(logits, 0)[arms].unsqueeze(1)  # one token per sample
        adv = grpo_advantages(reward_of[arms], torch.zeros(8, dtype=torch.long))
        per_token, valid, _ = grpo_token_losses(logp, logp.detach(), None, adv, torch.ones(8, 1), clip_eps_low=0.2,
                                                clip_eps_high=0.2, beta=0.0)
        total, norm = aggregate(per_token, valid, "token_mean")
        opt.zero_grad()
        (total / norm).backward()
        opt.step()
    assert torch.softmax(logits, 0)[2] > 0.95


def test_grpo_is_on_policy_and_grpo_and_ppo_take_any_sampling_temperature():
    """Their log-probs are of each row's sampling temperature (tests/test_sampler_temperature.py): the paper's
    sampling (T ~ U(0.1, 0.8), top-p 0.95) is accepted."""
    from megatron_spo.training.config import TrainConfig

    base = dict(init={"hf": "x"})
    for algo in ("grpo", "ppo"):
        assert tuple(TrainConfig.model_validate({**base, "algo": algo}).rollout.temperature_range) == (0.1, 0.8)
    with pytest.raises(ValueError, match="algo grpo is on-policy: use only the 'online' source"):
        TrainConfig.model_validate({**base, "algo": "grpo", "rollout": {"temperature_range": [1, 1], "top_p": 1},
                                    "sources": {"online": {}, "offline": {"path": "x"}}})


def test_beta_is_grpos_kl_coefficient_and_the_old_kl_coef_still_reads(caplog):
    """One name for the KL coefficient: GRPO reads beta; unset it is 0 for GRPO (its old kl_coef default, TRL's:
    no KL term) and 1/log(1e5) for the others; grpo.kl_coef maps to beta with one warning line, and a config
    dumped before the rename (beta and grpo.kl_coef both in it) reads as it acted then."""
    from megatron_spo.data.q0 import PAPER_BETA
    from megatron_spo.experiments.quickstart import QuickstartConfig
    from megatron_spo.training.config import TrainConfig

    base = {"init": {"hf": "x"}, "rollout": {"temperature_range": [1.0, 1.0], "top_p": 1.0}}
    assert TrainConfig.model_validate({**base, "algo": "grpo"}).beta == 0.0
    assert TrainConfig.model_validate({**base, "algo": "spo"}).beta == PAPER_BETA == 1 / math.log(1e5)
    with caplog.at_level("WARNING", logger="megatron_spo.config"):
        cfg = TrainConfig.model_validate({**base, "algo": "grpo", "grpo": {"kl_coef": 0.04}})
        assert (cfg.beta, cfg.grpo.kl_coef) == (0.04, None)
        again = TrainConfig.model_validate(cfg.model_dump(mode="json"))  # the ranks' copy: no second warning
    assert again.beta == 0.04
    assert [r.getMessage() for r in caplog.records if r.name == "megatron_spo.config"] == [
        "grpo.kl_coef is deprecated: the KL coefficient of every algorithm is beta (read as beta = 0.04)"]
    old = {**base, "beta": PAPER_BETA, "grpo": {"kl_coef": 0.0}}  # what every dump before the rename held
    assert TrainConfig.model_validate({**old, "algo": "grpo"}).beta == 0.0  # GRPO used kl_coef, not beta
    spo = TrainConfig.model_validate({**old, "algo": "spo"})
    assert (spo.beta, spo.grpo.kl_coef) == (PAPER_BETA, None)  # SPO used beta; kl_coef never acted
    with pytest.raises(ValueError, match=r"beta: algo spo needs beta > 0, got 0.0"):
        TrainConfig.model_validate({**base, "algo": "spo", "beta": 0})
    # the quickstart: the paper's beta for SPO (since 2026-11-26), 0.5 for PPO, 0 for GRPO (as its kl_coef was),
    # the old key still read
    assert QuickstartConfig().train.beta == PAPER_BETA
    assert QuickstartConfig(algo="ppo").train.beta == 0.5
    assert QuickstartConfig(algo="grpo").train.beta == 0.0
    assert QuickstartConfig.model_validate({"algo": "grpo", "grpo": {"kl_coef": 0.04}}).train.beta == 0.04
