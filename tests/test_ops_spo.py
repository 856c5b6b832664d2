"""spo_token_quantities: fused log-probs -> advantages -> cumulative Q, gradients only through the policy."""

from __future__ import annotations

import pytest
import torch

from megatron_spo.ops import spo_token_quantities, token_logprobs_reference

BETA = 0.25


def make_batch(b=3, t=9, h=8, v=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=gen)
    ref_hidden = hidden + 0.3 * torch.randn(b, t, h, generator=gen)
    weight, ref_weight = torch.randn(v, h, generator=gen), torch.randn(v, h, generator=gen)
    targets = torch.randint(0, v, (b, t), generator=gen)
    mask = torch.zeros(b, t, dtype=torch.bool)
    mask[0, 2:7] = True  # prompt, response, padding
    mask[1, 4:] = True  # response to the end
    mask[2, [1, 3, 4]] = True  # holes in the middle
    targets[~mask] = 10_000  # padding ids outside the vocabulary: masked tokens must never be looked up
    q0 = torch.tensor([-0.5, -0.1, -1.0])
    return hidden, ref_hidden, weight, ref_weight, targets, mask, q0


def q_by_loop(logp, ref_logp, mask, q0, beta):
    """Q_t by the definition: add A_t on response tokens, carry the last value over masked ones."""
    q = torch.empty_like(logp)
    for i in range(logp.shape[0]):
        running = q0[i].item()
        for t in range(logp.shape[1]):
            if mask[i, t]:
                running += beta * (logp[i, t] - ref_logp[i, t]).item()
            q[i, t] = running
    return q


def reference_logp(hidden, weight, targets, mask):
    flat = token_logprobs_reference(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1).clamp(max=weight.shape[0] - 1)
    )
    return torch.where(mask, flat.view(mask.shape), torch.zeros(()))


def test_values_match_the_definition_and_the_reference():
    hidden, ref_hidden, weight, ref_weight, targets, mask, q0 = make_batch()
    out = spo_token_quantities(
        hidden,
        weight,
        targets,
        mask,
        q0,
        BETA,
        ref_hidden=ref_hidden,
        ref_weight=ref_weight,
        chunk_size=4,
        vocab_tile=7,
    )
    logp, ref_logp = (
        reference_logp(hidden, weight, targets, mask),
        reference_logp(ref_hidden, ref_weight, targets, mask),
    )
    torch.testing.assert_close(out.logp, logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.ref_logp, ref_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        out.advantages, torch.where(mask, BETA * (logp - ref_logp), torch.zeros(())), rtol=0, atol=1e-5
    )
    torch.testing.assert_close(out.q, q_by_loop(logp, ref_logp, mask, q0, BETA), rtol=0, atol=1e-5)
    assert out.q[0, 0].item() == pytest.approx(q0[0].item())  # before the first response token: q0
    assert out.q[0, 8].item() == out.q[0, 6].item()  # padding after the response holds the last Q
    assert out.logp[~mask].abs().max().item() == 0.0


def test_parity_with_algorithms_cumulative_q():
    from megatron_spo import algorithms

    hidden, ref_hidden, weight, ref_weight, targets, mask, q0 = make_batch(seed=3)
    out = spo_token_quantities(
        hidden, weight, targets, mask, q0, BETA, ref_hidden=ref_hidden, ref_weight=ref_weight
    )
    expected = algorithms.cumulative_q(out.logp.detach(), out.ref_logp, mask, q0, BETA)
    torch.testing.assert_close(out.q.detach(), expected, rtol=0, atol=1e-6)


def test_gradients_flow_only_through_the_policy():
    hidden, ref_hidden, weight, ref_weight, targets, mask, q0 = make_batch(seed=1)
    leaves = [x.clone().requires_grad_() for x in (hidden, weight, ref_hidden, ref_weight)]
    out = spo_token_quantities(
        leaves[0], leaves[1], targets, mask, q0, BETA, ref_hidden=leaves[2], ref_weight=leaves[3]
    )
    assert not out.ref_logp.requires_grad
    coef = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))
    (out.q * coef).sum().backward()
    assert leaves[2].grad is None and leaves[3].grad is None

    # The same gradient through the plain reference: d/dtheta sum coef * (q0 + cumsum(beta * mask * (logp - ref)))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp = reference_logp(h, w, targets, mask)
    q = q0[:, None] + torch.where(
        mask, BETA * (logp - reference_logp(ref_hidden, ref_weight, targets, mask)), torch.zeros(())
    ).cumsum(1)
    (q * coef).sum().backward()
    torch.testing.assert_close(leaves[0].grad, h.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(leaves[1].grad, w.grad, rtol=0, atol=1e-5)
    assert leaves[0].grad[~mask].abs().max().item() == 0.0  # prompt/padding positions get no gradient


def test_precomputed_reference_logprobs_and_scalar_q0():
    hidden, ref_hidden, weight, ref_weight, targets, mask, _ = make_batch(seed=2)
    ref_logp = reference_logp(ref_hidden, ref_weight, targets, mask).requires_grad_()
    from_hidden = spo_token_quantities(
        hidden, weight, targets, mask, -0.3, BETA, ref_hidden=ref_hidden, ref_weight=ref_weight
    )
    policy_hidden = hidden.clone().requires_grad_()
    given = spo_token_quantities(policy_hidden, weight, targets, mask, -0.3, BETA, ref_logp=ref_logp)
    torch.testing.assert_close(given.q, from_hidden.q, rtol=0, atol=1e-5)
    assert from_hidden.q[:, 0].tolist() == pytest.approx([-0.3, -0.3, -0.3])  # no response token at t=0
    given.q.sum().backward()
    assert ref_logp.grad is None  # the reference is detached
    assert policy_hidden.grad[mask].abs().min().item() > 0


@pytest.mark.parametrize(
    "change, message",
    [
        ({"beta": 0.0}, "beta must be a finite number > 0, got 0.0"),
        ({"ref_hidden": None}, "pass exactly one of ref_logp or ref_hidden"),
        ({"ref_weight": None}, "ref_hidden needs ref_weight"),
        (
            {"mask": torch.ones(3, 8, dtype=torch.bool)},
            r"mask must be \[B, T\] = \(3, 9\), got shape \(3, 8\)",
        ),
        ({"q0": torch.zeros(2)}, r"q0 must be a float or \[B\] = \(3,\), got shape \(2,\)"),
    ],
)
def test_bad_input_is_named(change, message):
    hidden, ref_hidden, weight, ref_weight, targets, mask, q0 = make_batch()
    args = {"mask": mask, "q0": q0, "beta": BETA, "ref_hidden": ref_hidden, "ref_weight": ref_weight} | change
    with pytest.raises(ValueError, match=message):
        spo_token_quantities(
            hidden,
            weight,
            targets,
            args["mask"],
            args["q0"],
            args["beta"],
            ref_hidden=args["ref_hidden"],
            ref_weight=args["ref_weight"],
        )
