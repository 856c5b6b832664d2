"""SPO's coefficient transforms as a config names them (algorithms/spo_transforms.py): the fields centre,
trust_region, normalise and pg_coef map onto the list; a user's own transform, named as a hook, changes the
coefficient exactly as written, inside spo_loss and through the SPO algorithm's step."""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from extension_helpers import doubled_coefficient  # noqa: E402
from test_training_loss import _batch, _logps  # noqa: E402

from megatron_spo.algorithms import SPOInputs, spo_loss  # noqa: E402
from megatron_spo.algorithms.spo_transforms import TRANSFORMS, centre_groups, trust_region  # noqa: E402
from megatron_spo.config import ConfigError, load_config  # noqa: E402
from megatron_spo.data.batching import collate, group_numbers  # noqa: E402
from megatron_spo.training.algos.base import StepInputs  # noqa: E402
from megatron_spo.training.algos.spo import SPO  # noqa: E402
from megatron_spo.training.config import SourceConfig, TrainConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HOOK = "extension_helpers:doubled_coefficient"


def test_the_fields_map_onto_the_transform_list_and_a_listed_name_runs_where_the_list_puts_it():
    assert SourceConfig().transform_specs("online") == [("centre_groups", {}), ("trust_region", {"limit": 0.2})]
    assert SourceConfig().transform_specs("offline") == []
    assert SourceConfig(objective="mc").transform_specs("online") == []
    src = SourceConfig(centre=True, trust_region=0.1, normalise="token", pg_coef=0.5)
    assert src.transform_specs("offline") == [("centre_groups", {}), ("trust_region", {"limit": 0.1}),
                                              ("token_normalise", {}), ("policy_gradient", {"coef": 0.5})]
    # the fields' transforms join the list in TRANSFORMS order: the trust region after whichever centring runs
    assert [n for n, _ in SourceConfig(transforms=[HOOK]).transform_specs("online")] == [
        "centre_groups", "trust_region", HOOK]
    assert [n for n, _ in SourceConfig(transforms=[HOOK, "centre_groups"]).transform_specs("online")] == [
        HOOK, "centre_groups", "trust_region"]
    src = SourceConfig(transforms=["coefficient_baseline"], normalise="token")  # step-wide baselines every step
    assert [n for n, _ in src.transform_specs("online")] == ["coefficient_baseline", "trust_region", "token_normalise"]
    assert src.centred("online")
    assert SourceConfig(transforms=["centre_groups", "token_normalise"]).centred("offline")


@pytest.mark.parametrize("overrides, message", [
    (["sources.online.transforms=[centre]"],
     "sources.online.transforms.0: unknown transform 'centre' (choose from " + ", ".join(TRANSFORMS)
     + ", or a hook 'package.module:function') (got 'centre')"),
    (["sources.online.objective=mc", f"sources.online.transforms=[{HOOK},trust_region]"],
     "sources.online: transforms: trust_region needs objective terminal or advantage, not 'mc' (its loss is not "
     "a function of Q_T alone)"),
    (["sources.online.centre=false", "sources.online.transforms=[centre_groups]"],
     "sources.online: transforms: centre_groups is listed but centre is False (off)"),
    (["sources.online.transforms=[policy_gradient]"],
     "sources.online: transforms: policy_gradient is listed but pg_coef is 0.0 (off)"),
    (["sources.online.transforms=[centre_groups,coefficient_baseline]"],
     "sources.online: transforms: list one of centre_groups, coefficient_baseline (each centres the coefficient)"),
    (["sources.online.transforms=[token_normalise,token_normalise]"],
     "sources.online: transforms: 'token_normalise' is listed twice"),
    (["sources.off.path=a.jsonl", "sources.off.transforms=[trust_region]"],
     "sources.off.transforms: trust_region needs sources.off.trust_region > 0 (off by default for a source "
     "other than 'online')"),
])
def test_a_wrong_transform_list_is_one_line_naming_the_field(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TrainConfig, None, ["init.hf=x", *overrides])
    assert str(info.value) == message


def test_a_wrong_transform_hook_is_refused_at_start_naming_the_field(monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(TrainConfig, None, ["init.hf=x", "sources.online.transforms=[extension_helpers:nope]"])
    with pytest.raises(ConfigError, match=r"^sources.online.transforms: module 'extension_helpers' has no "
                                          r"attribute 'nope'$"):
        SPO(cfg)


def _case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(6, 5, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    ref = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 2
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[0, 3:] = False
    reward = torch.tensor([0.0, -1.0, 0.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    q0 = torch.full((6,), -0.4, dtype=torch.float64)
    return SPOInputs(logp, ref, mask, reward, q0, group=torch.tensor([0, 0, 0, 1, 1, 1]),
                     behaviour_logp=logp.detach() + 0.3 * torch.randn(6, 5, generator=gen, dtype=torch.float64))


def test_a_user_transform_that_doubles_the_coefficient_doubles_the_gradient_exactly():
    inputs = _case()
    kw = dict(beta=0.5, objective="terminal", loss="squared")
    for builtins in ([centre_groups], [centre_groups, partial(trust_region, limit=0.2)]):
        plain, m_plain = spo_loss(inputs, transforms=builtins, **kw)
        (g_plain,) = torch.autograd.grad(plain, inputs.logp)
        doubled, m_doubled = spo_loss(inputs, transforms=[*builtins, doubled_coefficient], **kw)
        (g_doubled,) = torch.autograd.grad(doubled, inputs.logp)
        assert torch.equal(g_doubled, 2 * g_plain) and float(g_plain.abs().max()) > 0
        assert doubled.item() == plain.item()  # the loss value is the regression loss, untouched
        assert m_doubled["coefficient_abs"] == 2 * m_plain["coefficient_abs"]
    with pytest.raises(ValueError, match=r"^spo_loss: doubled_coefficient needs objective terminal or advantage, "
                                         r"not 'reverse_q' \(its loss is not a function of Q_T alone\)$"):
        spo_loss(inputs, transforms=[doubled_coefficient], beta=0.5, objective="reverse_q", loss="squared")


def test_a_coefficient_set_with_dataclasses_replace_takes_effect_too():
    """A transform that bypasses SPOTerms.replace still changes the gradient: spo_loss compares the coefficient
    it handed out with the one it gets back."""
    import dataclasses

    inputs = _case()
    kw = dict(beta=0.5, objective="terminal", loss="squared")
    plain, _ = spo_loss(inputs, **kw)
    (g_plain,) = torch.autograd.grad(plain, inputs.logp)
    halved, _ = spo_loss(inputs, transforms=[lambda t: dataclasses.replace(t, coefficient=t.coefficient / 2)], **kw)
    (g_halved,) = torch.autograd.grad(halved, inputs.logp)
    assert torch.allclose(g_halved, g_plain / 2, rtol=1e-12, atol=0) and halved.item() == plain.item()


def _step_gradients(cfg, micro_rows):
    """Gradients of the policy log-probs [B, L] from one SPO.update over these micro-batches (a stand-in for
    the trainer's optimize / forward verbs), and the per-micro-batch reports."""
    trajs = _batch(11)
    for i, t in enumerate(trajs):
        t.source, t.reward = "online", -float(i % 3 == 0)
        t.behaviour_logprobs = [-0.9 + 0.2 * k for k in range(len(t.response_tokens))]
    full = collate(trajs, pad_id=0)
    logp_full, ref_full = _logps(full, 4)
    ids = group_numbers([t.prompt_id for t in trajs])  # the step's group ids, as the trainer numbers them
    mbs = [collate([trajs[i] for i in rows], pad_id=0, length=full.input_ids.shape[1],
                   group_ids=[ids[i] for i in rows]) for rows in micro_rows]
    grads = torch.zeros_like(logp_full)

    def optimize(model, output, loss_fn):
        reports = []
        for i, (mb, rows) in enumerate(zip(mbs, micro_rows)):
            lp = logp_full.detach()[rows].clone().requires_grad_()
            loss, metrics = loss_fn(i, mb, lp)
            loss.backward()
            grads[rows] += lp.grad
            reports.append(metrics)
        return reports, 0.0

    step = StepInputs(cfg=cfg, step=1, micro_batches=mbs, ref=[ref_full[rows] for rows in micro_rows],
                      lr=lambda model: 1.0, optimize=optimize, is_last_stage=True,
                      forward=lambda model, output: [logp_full.detach()[rows] for rows in micro_rows])
    update = SPO(cfg).update(step)
    return grads, update.reports


@pytest.mark.parametrize("micro_rows", [[list(range(8))], [[0, 1, 4], [2, 3, 5, 6], [7]]],
                         ids=["whole groups", "groups cut: step-wide baselines"])
def test_a_config_naming_the_transform_trains_through_the_spo_algorithm(micro_rows, monkeypatch):
    """sources.online.transforms names the hook: the SPO algorithm's step (centred inside the default trust region,
    within each micro-batch or on step-wide baselines) gives exactly twice the gradient of the same config
    without it."""
    monkeypatch.chdir(REPO)
    base = ["init.hf=x", "beta=0.4"]
    plain = load_config(TrainConfig, None, base)
    hooked = load_config(TrainConfig, None, [*base, f"sources.online.transforms=[{HOOK}]"])
    g_plain, r_plain = _step_gradients(plain, micro_rows)
    g_hooked, r_hooked = _step_gradients(hooked, micro_rows)
    assert torch.equal(g_hooked, 2 * g_plain) and float(g_plain.abs().max()) > 0
    assert r_plain[0]["trust_region_clipped/online"][0] > 0  # the trust region froze some tokens, in both
    for a, b in zip(r_plain, r_hooked):
        assert b["loss/online"] == a["loss/online"] and b["trust_region_clipped/online"] == a[
            "trust_region_clipped/online"]


def test_at_the_defaults_spos_online_gradient_is_twice_agros_off_policy_gradient_for_any_q0():
    """The online source's defaults (terminal objective, squared loss, centre_groups) make SPO's gradient
    2 x AGRO's off-policy one: c_i = 2 (Q_T,i - r_i) = -2 (R_i - Q0), R_i = r_i - beta log(pi / pi_0)(y_i), so the
    centred c_i - mean_{j != i} c_j = -2 (R_i - b_i) with AGRO's leave-one-out baseline b_i, whatever Q0 is (it
    cancels within a prompt group). Checked on random sequences in float64 (README, docs/spo-stability.md)."""
    import torch

    from megatron_spo import algorithms
    from megatron_spo.algorithms.spo_transforms import centre_groups

    g = torch.Generator().manual_seed(3)
    b, t = 8, 6
    logits = torch.randn(b, t, dtype=torch.float64, generator=g, requires_grad=True)
    ref = torch.randn(b, t, dtype=torch.float64, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    mask[:, 0] = True
    reward = -(torch.rand(b, generator=g) > 0.5).to(torch.float64)
    group = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    beta = 0.3
    agro, _ = algorithms.agro_loss(logits, ref, mask, reward, group, beta=beta, on_policy=False)
    (grad_agro,) = torch.autograd.grad(agro, logits)
    for q0 in (-0.9, -0.2, 0.0):
        inputs = algorithms.SPOInputs(logits, ref, mask, reward, torch.full((b,), q0, dtype=torch.float64),
                                      group=group)
        spo, _ = algorithms.spo_loss(inputs, beta=beta, objective="terminal", loss="squared",
                                     transforms=(centre_groups,))
        (grad_spo,) = torch.autograd.grad(spo, logits)
        torch.testing.assert_close(grad_spo, 2 * grad_agro, rtol=1e-9, atol=1e-12)
