"""Exact values, gradients and error messages of the SPO / AGRO / PPO math (megatron_spo.algorithms)."""

from __future__ import annotations

import ast
import math
import threading
from decimal import Decimal, getcontext
from pathlib import Path

import pytest
import python_ast
import torch
import torch.nn.functional as F

from megatron_spo.algorithms import (
    SPOInputs,
    agro_loss,
    cross_entropy_log_space,
    cumulative_q,
    gae,
    kl_pg_loss,
    kl_regularised_token_rewards,
    leave_one_out_stats,
    ppo_policy_loss,
    ppo_value_loss,
    q0_from_rewards,
    q0_from_success,
    reverse_q_targets,
    spo_loss,
    straight_through_clamp_max,
    supported_combinations,
    whiten_over_batch,
)

D = torch.float64
BETA = 0.5


def padded_batch(seed: int = 0, batch: int = 4, width: int = 6):
    """Random log-probs with left/right padding, NaN in ref_logp padding (must never be read)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width - 1, (batch,), generator=gen)
    offsets = torch.stack([torch.randint(0, width - int(n) + 1, (1,), generator=gen)[0] for n in lengths])
    cols = torch.arange(width)
    mask = (cols >= offsets[:, None]) & (cols < (offsets + lengths)[:, None])
    logp = -torch.rand(batch, width, generator=gen, dtype=D) * 2
    ref_logp = (-torch.rand(batch, width, generator=gen, dtype=D) * 2).masked_fill(~mask, float("nan"))
    reward = -torch.randint(0, 2, (batch,), generator=gen).to(D)
    q0 = -torch.rand(batch, generator=gen, dtype=D)
    return logp, ref_logp, mask, reward, q0


# ---------------------------------------------------------------------------------------------
# Cumulative Q, reverse-Q targets
# ---------------------------------------------------------------------------------------------
def test_cumulative_q_hand_example_holds_last_value_on_padding():
    logp = torch.tensor([[9.0, -1.0, -2.0, 9.0], [-1.0, -1.0, -0.5, -0.25]], dtype=D)
    ref = torch.tensor([[0.0, -2.0, -1.0, 0.0], [-1.0, -3.0, -0.5, -0.75]], dtype=D)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    q0 = torch.tensor([-0.25, -1.0], dtype=D)
    q = cumulative_q(logp, ref, mask, q0, BETA)
    # row 0: A = [_, 0.5, -0.5, _]; row 1: A = [0, 1, 0, 0.25]
    expected = torch.tensor([[-0.25, 0.25, -0.25, -0.25], [-1.0, 0.0, 0.0, 0.25]], dtype=D)
    assert torch.equal(q, expected)


def test_reverse_q_targets_values_and_identity():
    logp, ref, mask, reward, q0 = padded_batch()
    q = cumulative_q(logp, ref, mask, q0, BETA)
    targets = reverse_q_targets(logp, ref, mask, reward, BETA)
    # R_t = r - sum_{t' > t} A_t', hence Q_t - R_t = Q_T - r at every response position.
    for b in range(mask.shape[0]):
        cols = mask[b].nonzero().flatten().tolist()
        adv = [BETA * float(logp[b, c] - ref[b, c]) for c in cols]
        for i, c in enumerate(cols):
            assert float(targets[b, c]) == pytest.approx(float(reward[b]) - sum(adv[i + 1 :]), abs=1e-15)
            assert float(q[b, c] - targets[b, c]) == pytest.approx(float(q[b, -1] - reward[b]), abs=1e-14)
    assert not targets.requires_grad


# ---------------------------------------------------------------------------------------------
# Q0 estimates: exact and finite at the extremes
# ---------------------------------------------------------------------------------------------
def decimal_q0_from_success(s: float, beta: float) -> float:
    getcontext().prec = 60
    s_d, b_d = Decimal(s), Decimal(beta)
    return float(b_d * (s_d + (1 - s_d) * (-1 / b_d).exp()).ln())


@pytest.mark.parametrize("beta", [0.01, 1 / math.log(1e5), 0.3, 1.0, 3.0, 10.0])
def test_q0_from_success_extremes_exact_and_matches_high_precision(beta):
    s = torch.tensor([0.0, 1e-300, 1e-12, 0.25, 0.5, 1 - 1e-12, 1.0], dtype=D)
    q = q0_from_success(s, beta)
    assert torch.isfinite(q).all()
    assert float(q[0]) == -1.0  # S = 0: only failures, Q0 = r = -1 exactly
    assert float(q[-1]) == 0.0  # S = 1: only successes
    for s_i, q_i in zip(s.tolist()[1:-1], q.tolist()[1:-1], strict=True):
        assert q_i == pytest.approx(decimal_q0_from_success(s_i, beta), rel=1e-13, abs=1e-300)


@pytest.mark.parametrize("beta", [0.01, 0.1, 1.0, 10.0])
def test_q0_from_rewards_matches_success_formula_and_decimal(beta):
    # 3 successes out of 8 samples: the MC estimate equals the success-rate formula at S = 3/8.
    rewards = torch.tensor([0, -1, -1, 0, -1, -1, 0, -1], dtype=D)
    assert float(q0_from_rewards(rewards, beta)) == pytest.approx(
        float(q0_from_success(3 / 8, beta)), rel=1e-14
    )
    assert float(q0_from_rewards(torch.full((5,), -1.0, dtype=D), beta)) == pytest.approx(-1.0, rel=1e-15)
    assert float(q0_from_rewards(torch.zeros(5, dtype=D), beta)) == 0.0
    # Large magnitudes underflow exp() in a naive implementation; logsumexp keeps them exact.
    rewards = torch.tensor([-50.0, -60.0, -55.5], dtype=D)
    getcontext().prec = 60
    exact = Decimal(beta) * (sum((Decimal(r) / Decimal(beta)).exp() for r in rewards.tolist()) / 3).ln()
    assert float(q0_from_rewards(rewards, beta)) == pytest.approx(float(exact), rel=1e-13)


def test_q0_rejects_bad_input():
    with pytest.raises(ValueError, match=r"q0_from_success: p must lie in \[0, 1\]"):
        q0_from_success(torch.tensor([0.5, 1.5]), 0.5)
    with pytest.raises(ValueError, match="q0_from_rewards: beta must be a finite number > 0, got 0"):
        q0_from_rewards(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="q0_from_rewards: rewards has 1 non-finite values"):
        q0_from_rewards(torch.tensor([0.0, float("nan")]), 0.5)


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------
def test_straight_through_clip_passes_gradient_unchanged():
    y = torch.tensor([-2.0, -1e-9, 0.0, 0.7], dtype=D, requires_grad=True)
    upstream = torch.tensor([1.5, -2.0, 3.0, 0.25], dtype=D)
    out = straight_through_clamp_max(y, -1e-6)
    assert out.tolist() == [-2.0, -1e-6, -1e-6, -1e-6]
    (out * upstream).sum().backward()
    assert torch.equal(y.grad, upstream)


def test_cross_entropy_values_minimum_and_clipping():
    eps = 1e-3
    # Value: x relu(-y_hat) - (1 - x) log(1 - exp(y_hat)) with x = exp(y).
    y_hat = torch.tensor([-0.3, -2.0], dtype=D)
    y = torch.tensor([-1.0, -0.1], dtype=D)
    x = y.exp()
    expected = x * 0.3 * torch.tensor([1.0, 2.0 / 0.3], dtype=D) - (1 - x) * torch.log1p(-y_hat.exp())
    assert torch.allclose(cross_entropy_log_space(y_hat, y, eps), expected, rtol=0, atol=1e-15)
    # Minimised at y_hat = y: the gradient vanishes there.
    y_hat = torch.tensor([-0.05, -1.0, -7.0], dtype=D, requires_grad=True)
    cross_entropy_log_space(y_hat, y_hat.detach().clone(), eps).sum().backward()
    assert y_hat.grad.abs().max() < 1e-12
    # Above the clip: forward uses -eps, backward is the analytic gradient at -eps (straight through).
    y_hat = torch.tensor([0.3], dtype=D, requires_grad=True)
    loss = cross_entropy_log_space(y_hat, torch.tensor([-0.7], dtype=D), eps)
    x = math.exp(-0.7)
    assert loss.item() == pytest.approx(-(1 - x) * math.log(-math.expm1(-eps)), rel=1e-14)
    loss.backward()
    assert float(y_hat.grad) == pytest.approx((1 - x) * math.exp(-eps) / -math.expm1(-eps), rel=1e-12)
    # Target x = 1 (success) and y_hat > 0: relu removes any push; targets above 0 are clipped to 0.
    y_hat = torch.tensor([0.4], dtype=D, requires_grad=True)
    loss = cross_entropy_log_space(y_hat, torch.tensor([0.8], dtype=D), eps)
    loss.backward()
    assert loss.item() == 0.0 and float(y_hat.grad) == 0.0


# ---------------------------------------------------------------------------------------------
# spo_loss
# ---------------------------------------------------------------------------------------------
def test_spo_terminal_squared_value_and_gradient():
    logp, ref, mask, reward, q0 = padded_batch()
    logp.requires_grad_(True)
    loss, metrics = spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="terminal",
                             loss="squared")
    q_t = q0 + BETA * torch.where(mask, logp.detach() - ref, 0.0).sum(1)
    assert loss.item() == pytest.approx(float(((q_t - reward) ** 2).mean()), rel=1e-14)
    loss.backward()
    expected_grad = torch.where(mask, (2 * BETA * (q_t - reward) / mask.shape[0])[:, None], 0.0)
    assert torch.allclose(logp.grad, expected_grad, rtol=1e-13, atol=1e-15)
    assert metrics["terminal_q_abs_error"] == pytest.approx(float((q_t - reward).abs().mean()), rel=1e-14)
    seq_ratio = torch.where(mask, logp.detach() - ref, 0.0).sum(1)
    assert metrics["mean_seq_log_ratio"] == pytest.approx(float(seq_ratio.mean()), rel=1e-13)


def test_spo_reverse_q_squared_weights_earlier_tokens_more():
    logp, ref, mask, reward, q0 = padded_batch(seed=1)
    logp.requires_grad_(True)
    loss, _ = spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="reverse_q", loss="squared")
    q_t = q0 + BETA * torch.where(mask, logp.detach() - ref, 0.0).sum(1)
    n = mask.sum(1).to(D)
    assert loss.item() == pytest.approx(float((n * (q_t - reward) ** 2).mean()), rel=1e-13)
    loss.backward()
    # d/dlogp_t sum_{t' >= t} (Q_t' - R_t')^2 = 2 beta (Q_T - r) * (#response positions at or after t)
    later = mask.flip(1).cumsum(1).flip(1).to(D)
    expected = torch.where(mask, 2 * BETA * (q_t - reward)[:, None] * later / mask.shape[0], 0.0)
    assert torch.allclose(logp.grad, expected, rtol=1e-12, atol=1e-15)


def test_spo_advantage_objectives():
    logp, ref, mask, reward, q0 = padded_batch(seed=2)
    kw = dict(beta=BETA, objective="advantage")
    seq_adv = BETA * torch.where(mask, logp - ref, 0.0).sum(1)
    loss, _ = spo_loss(SPOInputs(logp, ref, mask, reward, q0), loss="sigmoid_bce", **kw)
    expected = F.binary_cross_entropy_with_logits(seq_adv / BETA, torch.sigmoid((reward - q0) / BETA))
    assert loss.item() == pytest.approx(float(expected), rel=1e-14)
    # Squared advantage regression has the same error as terminal regression (SPO paper 3.1.2).
    adv_sq, _ = spo_loss(SPOInputs(logp, ref, mask, reward, q0), loss="squared", **kw)
    term_sq, _ = spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="terminal",
                          loss="squared")
    assert float(adv_sq) == pytest.approx(float(term_sq), rel=1e-13)


def test_spo_mc_targets_at_sparse_positions():
    logp, ref, mask, reward, q0 = padded_batch(seed=3, batch=2)
    ref = ref.nan_to_num(nan=-1.25)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    positions = torch.tensor([[3, -1, 1], [0, 4, -1]])
    success = torch.tensor([[0.25, 0.9, 1.0], [0.0, 0.5, 0.3]], dtype=D)
    q = cumulative_q(logp, ref, mask, q0, BETA)
    for loss_name in ("squared", "cross_entropy", "sigmoid_bce"):
        loss, _ = spo_loss(
            SPOInputs(logp, ref, mask, reward, q0, mc_positions=positions, mc_success=success),
            beta=BETA, objective="mc", loss=loss_name,
        )  # fmt: skip
        total = 0.0
        for b in range(2):
            for k in range(3):
                t = int(positions[b, k])
                if t < 0:
                    continue
                target = float(q0_from_success(float(success[b, k]), BETA))
                pred = float(q[b, t])
                if loss_name == "squared":
                    total += (pred - target) ** 2
                elif loss_name == "cross_entropy":
                    x = math.exp(target / BETA)
                    total += x * max(-pred / BETA, 0) - (1 - x) * math.log(
                        -math.expm1(min(pred / BETA, -1e-6))
                    )
                else:
                    p = 1 / (1 + math.exp(-target / BETA))
                    z = pred / BETA
                    total += max(z, 0) - z * p + math.log1p(math.exp(-abs(z)))
        assert loss.item() == pytest.approx(total / 2, rel=1e-12), loss_name
    # mc_q gives the same loss with targets in reward units.
    q_targets = q0_from_success(success, BETA)
    a, _ = spo_loss(
        SPOInputs(logp, ref, mask, reward, q0, mc_positions=positions, mc_q=q_targets),
        beta=BETA,
        objective="mc",
        loss="squared",
    )
    b, _ = spo_loss(
        SPOInputs(logp, ref, mask, reward, q0, mc_positions=positions, mc_success=success),
        beta=BETA,
        objective="mc",
        loss="squared",
    )
    assert float(a) == pytest.approx(float(b), rel=1e-14)


def test_spo_supported_combinations_and_clear_refusals():
    assert len(supported_combinations()) == 11
    logp, ref, mask, reward, q0 = padded_batch()
    with pytest.raises(
        ValueError, match="spo_loss: objective 'advantage' with loss 'cross_entropy' is not supported"
    ):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="advantage", loss="cross_entropy")
    with pytest.raises(ValueError, match="spo_loss: unknown objective 'td'"):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="td", loss="squared")
    with pytest.raises(ValueError, match="spo_loss: unknown loss 'huber'"):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="terminal", loss="huber")
    with pytest.raises(ValueError, match="spo_loss: objective 'mc' needs mc_positions"):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="mc", loss="squared")
    positions = torch.full((4, 1), 0)  # column 0 is padding in some rows
    with pytest.raises(ValueError, match=r"spo_loss: mc_positions points at padding \(mask 0\)"):
        spo_loss(
            SPOInputs(logp, ref, mask, reward, q0, mc_positions=positions, mc_success=torch.ones(4, 1, dtype=D)),
            beta=BETA, objective="mc", loss="squared",
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------------
def test_validation_messages_name_argument_and_problem():
    logp, ref, mask, reward, q0 = padded_batch(batch=2, width=5)
    kw = dict(beta=BETA, objective="terminal", loss="squared")
    with pytest.raises(ValueError, match=r"^spo_loss: logp shape \(2, 5\) != mask shape \(2, 4\)$"):
        spo_loss(SPOInputs(logp, ref[:, :4], mask[:, :4], reward, q0), **kw)
    with pytest.raises(ValueError, match=r"^spo_loss: reward has 2 NaN values$"):
        spo_loss(SPOInputs(logp, ref, mask, torch.full((2,), float("nan"), dtype=D), q0), **kw)
    with pytest.raises(ValueError, match=r"^spo_loss: q0 shape \(3,\) != \(2,\)"):
        spo_loss(SPOInputs(logp, ref, mask, reward, torch.zeros(3, dtype=D)), **kw)
    bad = logp.clone()
    bad[mask] = float("-inf")
    with pytest.raises(ValueError, match=r"^spo_loss: logp has \d+ inf values at response positions$"):
        spo_loss(SPOInputs(bad, ref, mask, reward, q0), **kw)
    empty = mask.clone()
    empty[1] = False
    with pytest.raises(
        ValueError, match=r"^spo_loss: mask has 1 empty response\(s\) \(rows 1 have no tokens\)$"
    ):
        spo_loss(SPOInputs(logp, ref, empty, reward, q0), **kw)
    with pytest.raises(ValueError, match=r"^agro_loss: reward has 1 inf values$"):
        agro_loss(
            logp,
            ref,
            mask,
            torch.tensor([0.0, float("inf")], dtype=D),
            torch.zeros(2),
            beta=BETA,
            on_policy=False,
        )
    with pytest.raises(ValueError, match=r"^spo_loss: beta must be a finite number > 0, got -1"):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0), beta=-1, objective="terminal", loss="squared")


def test_non_finite_padding_is_never_read():
    logp, ref, mask, reward, q0 = padded_batch(seed=4)
    logp = logp.masked_fill(~mask, float("-inf")).requires_grad_(True)  # engines report null/-inf there
    for objective, loss_name in supported_combinations():
        extra = {}
        if objective == "mc":
            first = mask.to(torch.int64).argmax(1, keepdim=True)
            extra = dict(mc_positions=first, mc_success=torch.full(first.shape, 0.5, dtype=D))
        loss, metrics = spo_loss(
            SPOInputs(logp, ref, mask, reward, q0, **extra), beta=BETA, objective=objective, loss=loss_name
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (objective, loss_name)
        assert float(grad[~mask].abs().max()) == 0.0
        assert all(math.isfinite(v) for v in metrics.values())


# ---------------------------------------------------------------------------------------------
# AGRO and the KL-regularised policy gradient
# ---------------------------------------------------------------------------------------------
def test_leave_one_out_stats_match_brute_force():
    gen = torch.Generator().manual_seed(5)
    group = torch.tensor([7, 7, 7, 2, 2, 2, 2, 2, 9, 9, 9, 9])[torch.randperm(12, generator=gen)]
    values = torch.randn(12, generator=gen, dtype=D) * 3 + 100.0  # offset: no cancellation allowed
    minus_b, var_others, group_var = leave_one_out_stats(values, group, 3, "test")
    for i in range(12):
        others = values[(group == group[i]) & (torch.arange(12) != i)]
        members = values[group == group[i]]
        assert float(minus_b[i]) == pytest.approx(float(values[i] - others.mean()), abs=1e-12)
        assert float(var_others[i]) == pytest.approx(float(others.var(unbiased=True)), rel=1e-10)
        assert float(group_var[i]) == pytest.approx(float(members.var(unbiased=True)), rel=1e-10)


@pytest.mark.parametrize("on_policy", [False, True])
def test_agro_gradient_matches_definition(on_policy):
    logp, ref, mask, reward, _ = padded_batch(seed=6, batch=10)
    group = torch.tensor([0, 1, 0, 2, 1, 1, 0, 2, 1, 2])  # uneven sizes 3, 4, 3
    logp.requires_grad_(True)
    loss, metrics = agro_loss(logp, ref, mask, reward, group, beta=BETA, on_policy=on_policy)
    loss.backward()
    seq_ratio = torch.where(mask, logp.detach() - ref, 0.0).sum(1)
    big_r = reward - BETA * seq_ratio
    expected = torch.zeros_like(logp)
    for i in range(10):
        idx = [j for j in range(10) if group[j] == group[i] and j != i]
        b_i = big_r[idx].mean()
        coef = -BETA * (big_r[i] - b_i)
        if on_policy:
            coef = coef + 0.5 * ((big_r[i] - b_i) ** 2 - big_r[idx].var(unbiased=True))
        expected[i] = torch.where(mask[i], coef / 10, 0.0)
    assert torch.allclose(logp.grad, expected, rtol=1e-12, atol=1e-15)
    assert metrics["mean_regularised_reward"] == pytest.approx(float(big_r.mean()), rel=1e-13)


def test_agro_gradient_vanishes_at_constant_regularised_reward():
    logp, ref, mask, _, _ = padded_batch(seed=7, batch=6)
    seq_ratio = torch.where(mask, logp - ref, 0.0).sum(1)
    reward = BETA * seq_ratio - 0.4  # R = r - beta log(pi / pi_0) = -0.4 for every response: the optimum
    logp.requires_grad_(True)
    for on_policy in (False, True):
        loss, _ = agro_loss(
            logp, ref, mask, reward, torch.tensor([0, 0, 0, 1, 1, 1]), beta=BETA, on_policy=on_policy
        )
        (grad,) = torch.autograd.grad(loss, logp)
        assert float(grad.abs().max()) < 1e-14


def test_agro_refuses_small_groups():
    logp, ref, mask, reward, _ = padded_batch(batch=4)
    with pytest.raises(
        ValueError, match="agro_loss: every prompt group needs >= 3 responses .* the smallest has 2"
    ):
        agro_loss(logp, ref, mask, reward, torch.tensor([0, 0, 1, 1]), beta=BETA, on_policy=True)
    with pytest.raises(
        ValueError, match="kl_pg_loss: every prompt group needs >= 2 responses .* the smallest has 1"
    ):
        kl_pg_loss(logp, ref, mask, reward, torch.tensor([0, 0, 0, 1]), beta=BETA)


def test_kl_pg_gradient():
    logp, ref, mask, reward, _ = padded_batch(seed=8, batch=4)
    logp.requires_grad_(True)
    loss, _ = kl_pg_loss(logp, ref, mask, reward, torch.tensor([0, 0, 1, 1]), beta=BETA)
    loss.backward()
    r_minus_b = torch.stack(
        [reward[0] - reward[1], reward[1] - reward[0], reward[2] - reward[3], reward[3] - reward[2]]
    )
    expected = torch.where(mask, ((-r_minus_b + BETA) / 4)[:, None], 0.0)
    assert torch.allclose(logp.grad, expected, rtol=1e-13, atol=1e-15)


# ---------------------------------------------------------------------------------------------
# PPO pieces
# ---------------------------------------------------------------------------------------------
def test_kl_regularised_token_rewards():
    logp = torch.tensor([[0.0, -1.0, -2.0, 0.0], [-0.5, -0.5, 0.0, 0.0]], dtype=D)
    ref = torch.tensor([[0.0, -1.5, -1.0, 0.0], [-1.0, -0.25, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    out = kl_regularised_token_rewards(torch.tensor([-1.0, 0.0], dtype=D), logp, ref, mask, beta=BETA)
    expected = torch.tensor([[0.0, -0.25, 0.5 - 1.0, 0.0], [-0.25, 0.125, 0.0, 0.0]], dtype=D)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("gamma,lam,width", [(1.0, 1.0, 7), (0.9, 0.8, 7), (1.0, 0.0, 7), (0.99, 0.95, 600)])
def test_gae_matches_reference_loop(gamma, lam, width):
    _, _, mask, _, _ = padded_batch(seed=9, batch=3, width=width)  # width 600: several scan chunks
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(mask.shape, generator=gen, dtype=D)
    values = torch.randn(mask.shape, generator=gen, dtype=D)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    for b in range(mask.shape[0]):
        cols = mask[b].nonzero().flatten().tolist()
        running = 0.0
        for i in reversed(range(len(cols))):
            c = cols[i]
            next_v = float(values[b, cols[i + 1]]) if i + 1 < len(cols) else 0.0
            delta = float(rewards[b, c]) + gamma * next_v - float(values[b, c])
            running = delta + gamma * lam * running
            assert float(adv[b, c]) == pytest.approx(running, abs=1e-12)
            assert float(ret[b, c]) == pytest.approx(running + float(values[b, c]), abs=1e-12)
    assert float(adv[~mask].abs().max()) == 0.0 and float(ret[~mask].abs().max()) == 0.0


def test_gae_runs_over_the_model_tokens_of_a_multi_turn_response():
    """Environment tokens inside a response (mask 0 between model turns) are context: the next value is the next
    model token's, as the loop over the valid columns above computes; rows without gaps are unchanged."""
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 1, 1], [1, 1, 0, 1, 0]], dtype=torch.bool)
    gen = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(3, 5, generator=gen, dtype=D), torch.randn(3, 5, generator=gen, dtype=D)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for b in range(3):
        cols, running = mask[b].nonzero().flatten().tolist(), 0.0
        for i in reversed(range(len(cols))):
            c = cols[i]
            next_v = float(values[b, cols[i + 1]]) if i + 1 < len(cols) else 0.0
            running = float(rewards[b, c]) + 0.9 * next_v - float(values[b, c]) + 0.9 * 0.8 * running
            assert float(adv[b, c]) == pytest.approx(running, abs=1e-12)
            assert float(ret[b, c]) == pytest.approx(running + float(values[b, c]), abs=1e-12)
    assert float(adv[~mask].abs().max()) == 0.0 and float(ret[~mask].abs().max()) == 0.0


def test_ppo_policy_loss_clipping_values_and_gradients():
    behaviour = torch.zeros(1, 4, dtype=D)
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7]], dtype=D)
    logp = ratios.log().requires_grad_(True)
    adv = torch.tensor([[1.0, -2.0, 3.0, 1.0]], dtype=D)
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, metrics = ppo_policy_loss(logp, behaviour, adv, mask, clip_eps=0.2, reduction="token")
    # per token -min(wA, clip(w)A): 1.5*1 -> clipped 1.2; 0.5*-2 -> -1.0 vs 0.8*-2=-1.6: min -1.6 (clipped);
    # 1.1*3 = 3.3 (inside); 0.7*1 = 0.7 vs 0.8: min 0.7 (unclipped)
    expected = -(1.2 - 1.6 + 3.3 + 0.7) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-14)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # Clipped tokens get no gradient; others get -w A / 4 (d w / d logp = w).
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 0.0, -3.3 / 4, -0.7 / 4]], dtype=D), atol=1e-15)
    seq, _ = ppo_policy_loss(ratios.log(), behaviour, adv, mask, clip_eps=0.2, reduction="sequence")
    assert float(seq) == pytest.approx(expected * 4, rel=1e-14)


def test_ppo_value_loss_clipped():
    values = torch.tensor([[1.0, 0.0, 2.0]], dtype=D, requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 2.1]], dtype=D)
    returns = torch.tensor([[2.0, 1.0, 2.0]], dtype=D)
    mask = torch.tensor([[1, 1, 0]])
    loss = ppo_value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: (1-2)^2=1 vs (0.7-2)^2=1.69 -> 1.69; token 1: (0-1)^2=1 vs (0.3-1)^2=0.49 -> 1; token 2 masked
    assert loss.item() == pytest.approx(0.5 * (1.69 + 1.0), rel=1e-14)
    loss.backward()
    assert torch.allclose(values.grad, torch.tensor([[0.0, -1.0, 0.0]], dtype=D))
    assert ppo_value_loss(values, old, returns, mask).item() == pytest.approx(0.5 * 2.0, rel=1e-14)


def test_whitening_is_over_the_whole_step_however_it_is_packed_or_sharded():
    g = torch.Generator().manual_seed(0)
    adv = torch.randn(6, 9, generator=g, dtype=torch.float32) * 3 + 1
    mask = torch.zeros(6, 9)
    for row, (a, b) in enumerate([(2, 9), (0, 4), (3, 7), (1, 9), (5, 6), (0, 9)]):
        mask[row, a:b] = 1
    valid = mask.bool()
    expect = torch.where(valid, (adv - adv[valid].mean()) / adv[valid].std(unbiased=False), torch.zeros_like(adv))
    [whole] = whiten_over_batch([adv], [mask])
    torch.testing.assert_close(whole, expect, rtol=0, atol=2e-6)
    assert whole.dtype == adv.dtype and whole[~valid].abs().max() == 0
    # two micro-batches: the same numbers as one (per micro-batch whitening would differ)
    parts = whiten_over_batch([adv[:2], adv[2:]], [mask[:2], mask[2:]])
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-6)
    alone = whiten_over_batch([adv[:2]], [mask[:2]])[0]
    assert (alone - whole[:2]).abs().max() > 0.1
    # two data-parallel ranks (threads), summing through an all-reduce made of a barrier: each gets its rows
    # of the whole step's whitening
    barrier, slots, out = threading.Barrier(2), [None, None], [None, None]

    def rank(r: int, rows: slice) -> None:
        def all_reduce(t):
            slots[r] = t.clone()
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()
            return total

        out[r] = whiten_over_batch([adv[rows]], [mask[rows]], all_reduce)[0]

    threads = [threading.Thread(target=rank, args=(r, rows)) for r, rows in enumerate((slice(0, 3), slice(3, 6)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.testing.assert_close(torch.cat(out), whole, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="whiten_over_batch: no response tokens in the step"):
        whiten_over_batch([adv], [torch.zeros_like(mask)])


# ---------------------------------------------------------------------------------------------
# Layering: algorithms/ is pure torch
# ---------------------------------------------------------------------------------------------
def test_algorithms_import_only_torch_and_stdlib():
    allowed_roots = {"torch", "math", "numbers", "itertools", "collections", "dataclasses", "__future__", "megatron_spo"}
    folder = Path(__file__).resolve().parents[1] / "megatron_spo" / "algorithms"
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(python_ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] in allowed_roots, f"{path.name} imports {name}"
                if name.startswith("megatron_spo"):
                    assert name.startswith("megatron_spo.algorithms"), f"{path.name} imports {name}"


def test_half_precision_log_probs_are_summed_in_float32():
    logp, ref, mask, reward, q0 = padded_batch(seed=12, batch=3, width=6)
    ref = ref.nan_to_num(nan=0.0)
    logp_bf16 = logp.to(torch.bfloat16).requires_grad_(True)
    ref_bf16 = ref.to(torch.bfloat16)
    kw = dict(beta=BETA, objective="reverse_q", loss="squared")
    loss, _ = spo_loss(SPOInputs(logp_bf16, ref_bf16, mask, reward.float(), q0.float()), **kw)
    reference, _ = spo_loss(
        SPOInputs(logp_bf16.detach().float(), ref_bf16.float(), mask, reward.float(), q0.float()), **kw
    )
    assert loss.dtype == torch.float32 and loss.item() == reference.item()
    loss.backward()
    assert logp_bf16.grad.dtype == torch.bfloat16
    agro, _ = agro_loss(logp_bf16, ref_bf16, mask, reward.float(), torch.zeros(3), beta=BETA, on_policy=True)
    assert agro.dtype == torch.float32
