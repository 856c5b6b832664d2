"""SPO's drift off its own samples and the remedies (MATH.md section 7; issue 26).

Exact checks on small cases: the centred coefficient's gradient, pi* staying a fixed point under any sampler,
the on-policy expected gradient unchanged, the diagnostics' values, the learning-rate schedule and the guard.
"""

from __future__ import annotations

import itertools
import math
from functools import partial

import pytest
import torch

from megatron_spo.algorithms import SPOInputs, recurrent_drift, spo_loss, tabular
from megatron_spo.algorithms.groups import centred_on_others
from megatron_spo.algorithms.spo_diagnostics import spo_diagnostics
from megatron_spo.algorithms.spo_transforms import (
    centre_groups,
    coefficient_baseline,
    policy_gradient,
    trust_region,
)
from megatron_spo.data.q0 import PAPER_BETA
from megatron_spo.training.stability import DivergenceGuard, TrainingDiverged, lr_at

BETA = 0.5


def _case(seed=0, b=6, t=5):
    gen = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=gen, dtype=torch.float64) * 2).requires_grad_(True)
    ref = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 2
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[0, 3:] = False
    reward = torch.tensor([0.0, -1.0, 0.0, -1.0, -1.0, 0.0], dtype=torch.float64)[:b]
    q0 = torch.full((b,), -0.4, dtype=torch.float64)
    group = torch.tensor([0, 0, 0, 1, 1, 1])[:b]
    return logp, ref, mask, reward, q0, group


def test_centred_coefficient_gradient_is_the_leave_one_out_control_variate():
    logp, ref, mask, reward, q0, group = _case()
    loss, metrics = spo_loss(SPOInputs(logp, ref, mask, reward, q0, group=group), beta=BETA, objective="terminal",
                             loss="squared", transforms=[centre_groups])
    loss.backward()
    with torch.no_grad():
        q_t = q0 + BETA * torch.where(mask, logp - ref, 0.0).sum(1)
        c = 2 * (q_t - reward)
        others = torch.stack([c[(group == group[i]) & (torch.arange(6) != i)].mean() for i in range(6)])
        expected = ((c - others) * BETA / 6).unsqueeze(1) * mask
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-12)
    # the reported loss is the plain regression loss, not the surrogate
    assert loss.item() == pytest.approx(float(((q_t - reward) ** 2).mean()), abs=1e-12)
    assert metrics["coefficient_abs"] == pytest.approx(float((c - others).abs().mean()), abs=1e-12)


def test_a_sequence_alone_in_its_group_is_centred_on_all_others():
    values = torch.tensor([1.0, 2.0, 3.0, 10.0])
    assert centred_on_others(values, torch.tensor([0, 0, 0, 1])).tolist() == [-1.5, 0.0, 1.5, 8.0]
    assert centred_on_others(torch.tensor([4.0]), torch.tensor([7])).tolist() == [4.0]


def test_centring_is_refused_for_objectives_that_are_not_a_function_of_q_terminal():
    logp, ref, mask, reward, q0, group = _case()
    with pytest.raises(ValueError, match="centre_groups needs objective terminal or advantage, not 'reverse_q'"):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0, group=group), beta=BETA, objective="reverse_q",
                 loss="squared", transforms=[centre_groups])


def _gradient_at(task, logits, seqs, q0, centre):
    gen = torch.Generator().manual_seed(0)
    batch = tabular.make_batch(task, seqs, group_size=8, generator=gen)
    logits = logits.clone().requires_grad_(True)
    loss, _ = spo_loss(SPOInputs(batch.token_logp(logits), batch.token_logp(task.ref_logits), batch.mask,
                                 batch.reward, torch.full_like(batch.q0, q0), group=batch.group),
                       beta=task.beta, objective="terminal", loss="squared", transforms=[centre_groups] if centre else [])
    loss.backward()
    return logits.grad


def test_pi_star_is_a_fixed_point_of_the_centred_loss_under_any_sampler():
    """At pi* every response's residual is Q0 - V; with Q0 off by 0.2 and samples of a tempered sampler, the plain
    loss still pushes pi off pi* (the drift), the centred one does not move it at all."""
    task = tabular.autoregressive(3, 3, beta=BETA, seed=1)
    star = tabular.optimal_logits(task)
    gen = torch.Generator().manual_seed(3)
    seqs = tabular.sample_sequences(task, star / 0.7, 64, gen)  # a sharper sampler than pi*
    plain = _gradient_at(task, star, seqs, task.q0 + 0.2, centre=False)
    centred = _gradient_at(task, star, seqs, task.q0 + 0.2, centre=True)
    assert float(plain.abs().max()) > 1e-3
    assert float(centred.abs().max()) < 1e-12


def test_on_policy_the_centred_expected_gradient_equals_the_plain_one():
    """Exact expectation over every pair of responses (groups of 2) drawn from pi itself."""
    task = tabular.bandit(4, beta=BETA, seed=2)
    logits = task.ref_logits + 0.3 * torch.randn(task.ref_logits.shape, generator=torch.Generator().manual_seed(1),
                                                 dtype=torch.float64)
    probs = task.sequence_logp(logits).exp()
    expected = {}
    for centre in (False, True):
        total = torch.zeros_like(logits)
        for i, j in itertools.product(range(4), repeat=2):
            total += probs[i] * probs[j] * _gradient_at(task, logits, torch.tensor([i, j]), task.q0 - 0.1, centre)
        expected[centre] = total
    torch.testing.assert_close(expected[True], expected[False], rtol=0, atol=1e-12)


def test_diagnostics_values_on_a_hand_case():
    logp = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-0.5, -0.5, -0.5, -0.5]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, 0.0, 0.0], [-1.0, -1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    reward = torch.tensor([0.0, -1.0], dtype=torch.float64)
    q0 = torch.tensor([-0.2, -0.2], dtype=torch.float64)
    behaviour = torch.tensor([[-1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    pairs = spo_diagnostics(logp, ref, mask, reward, q0, beta=BETA, group=torch.tensor([0, 0]),
                            behaviour_logp=behaviour)
    d = {k: v for k, (v, _) in pairs.items()}
    # Q_T - r: -0.2 + 0.5 * (0.5 - 1.0) - 0 = -0.45 and -0.2 + 0.5 * 2.0 + 1 = 1.8
    assert d["residual_mean"] == pytest.approx((-0.45 + 1.8) / 2)
    assert d["residual_sq"] == pytest.approx((0.45**2 + 1.8**2) / 2)
    assert d["residual_group_var"] == pytest.approx(((1.8 + 0.45) / 2) ** 2)
    assert d["response_length"] == 3.0
    # quarters: row 0 (2 tokens) fills bins 1 and 3, row 1 (4 tokens) one token per bin
    assert pairs["log_ratio_pos1"] == (pytest.approx((0.5 + 0.5) / 2), 2)
    assert pairs["log_ratio_pos2"] == (pytest.approx(0.5), 1)
    assert pairs["log_ratio_pos3"] == (pytest.approx((-1.0 + 0.5) / 2), 2)
    # Q_t at each quarter's last token: row 0 Q = -0.2 + 0.5 * [0.5, -0.5] cumulated = [0.05, -0.45] (bins 1, 3),
    # row 1 -0.2 + 0.25 per token = [0.05, 0.3, 0.55, 0.8]
    assert pairs["q_pos1"] == (pytest.approx(0.05), 2) and pairs["q_pos2"] == (pytest.approx(0.3), 1)
    assert pairs["q_pos3"] == (pytest.approx((-0.45 + 0.55) / 2), 2) and pairs["q_pos4"] == (pytest.approx(0.8), 1)
    # KL(mu || pi) from the one row with behaviour log-probs: log mu - log pi = [0, 1]
    assert pairs["kl_sampler_k1"] == (pytest.approx(1.0), 1)
    assert pairs["kl_sampler_k3"] == (pytest.approx(math.exp(-1.0) - 1 + 1.0), 1)


def test_learning_rate_schedules():
    kw = dict(warmup_steps=10, total_steps=110)
    assert lr_at(5, 1.0, **kw) == 0.5
    assert lr_at(10, 1.0, **kw) == 1.0 and lr_at(110, 1.0, **kw) == 1.0
    assert lr_at(60, 1.0, decay="linear", min_lr_fraction=0.1, **kw) == pytest.approx(0.55)
    assert lr_at(110, 1.0, decay="linear", min_lr_fraction=0.1, **kw) == pytest.approx(0.1)
    assert lr_at(60, 1.0, decay="cosine", min_lr_fraction=0.0, **kw) == pytest.approx(0.5)
    assert lr_at(500, 1.0, decay="cosine", min_lr_fraction=0.2, **kw) == pytest.approx(0.2)


def test_divergence_guard_fires_on_a_sustained_residual_and_resets_below_it():
    guard = DivergenceGuard(max_log_ratio=50.0, max_residual=1.0, patience=3)
    for step, value in enumerate([1.5, 1.5, 0.5, 1.5, 1.5], start=1):  # the dip resets the count
        guard.check(step, {"residual_mean/online": value, "residual_mean/offline": -2.0})
    with pytest.raises(TrainingDiverged, match=r"step 6: the mean residual Q_T - r on source 'online' has stayed "
                       r"above logging.max_residual 1.0 for 3 steps .*sources.online.centre=true"):
        guard.check(6, {"residual_mean/online": 1.2})
    with pytest.raises(TrainingDiverged, match="exceeds logging.max_log_ratio 50.0"):
        DivergenceGuard(50.0, None, 3).check(1, {"mean_seq_log_ratio": -60.0})
    # a residual whose mean changes sign while its spread grows: only the root-mean-square limit sees it
    rms = DivergenceGuard(None, 1.0, 2, max_residual_rms=1.5)
    rms.check(1, {"residual_mean/online": -0.3, "residual_sq/online": 1.5**2 + 0.01})
    with pytest.raises(TrainingDiverged, match=r"step 2: the root-mean-square residual Q_T - r on source 'online' "
                       r"has stayed above logging.max_residual_rms 1.5 for 2 steps \(now 2.3\)"):
        rms.check(2, {"residual_mean/online": 0.2, "residual_sq/online": 2.3**2})


def test_stale_tempered_samples_hold_the_plain_loss_off_pi_star_and_the_centred_one_reaches_it():
    """The reproduction on a table (vocabulary 5, length 4, every response enumerated): samples from a copy of
    the policy refreshed every 10 steps at T ~ U(0.7, 1), Q0 off by +0.3, Adam lr 0.1, clip 1. The plain squared
    loss stalls at KL(pi || pi*) ~0.1 (the mean residual pushes pi off its sampler); the centred one goes 8x
    closer (~0.015). Measured: plain 0.122 / centred 0.0146 at step 200 (seed 0)."""
    torch.set_num_threads(1)
    task = tabular.autoregressive(5, 4, beta=BETA, seed=0)
    plain = tabular.train_from_stale_sampler(task, centre=False, steps=200)
    centred = tabular.train_from_stale_sampler(task, centre=True, steps=200)
    assert plain.kl_end > 0.08
    assert centred.kl_end < 0.03
    assert plain.kl_end > 4 * centred.kl_end


def test_a_network_collapses_on_stale_samples_under_the_old_loss_and_holds_centred_inside_the_trust_region():
    """What a table cannot show (algorithms/recurrent_drift.py): a GRU policy, every response enumerated, samples
    from a copy refreshed every 10 steps at T ~ U(0.7, 1), Q0 overshooting V by 0.8, Adam lr 1e-2, clip 1. The
    old loss (uncentred, no trust region) blows KL(pi || pi*) up 10x within 200 steps while its signed residual
    climbs past Q0's own error; the new online defaults stay below the start and learn. Measured at 200 steps,
    seed 0: plain peak KL 3.03, residual up to +1.39; centred + trust region 0.2: KL 0.276 -> at most 0.125,
    residual at most +0.89, success 0.139 -> 0.377 (pi*: 0.439). (At 300 steps: held KL 0.112, success 0.362.)"""
    torch.set_num_threads(1)
    task = recurrent_drift.CountTask()
    plain = recurrent_drift.train_from_stale_sampler(task, centre=False, steps=200, record_every=100)
    held = recurrent_drift.train_from_stale_sampler(task, centre=True, trust_region=0.2, steps=200,
                                                    record_every=100)
    start = plain.measures[0]
    assert held.measures[0] == start and 0.4 < plain.optimum_success < 0.5
    assert plain.peak_kl > 5 * start.kl_to_optimum
    assert max(plain.residual_mean) > 1.2 > 1.0 > max(held.residual_mean)
    assert max(m.kl_to_optimum for m in held.measures[1:]) < 0.6 * start.kl_to_optimum
    assert held.final.success > start.success + 0.15


def test_refreshing_the_reference_moves_the_fixed_point_past_pi_star_towards_the_highest_reward():
    """The paper's suggestion on the same network: the reference becomes the policy every 50 steps and Q0 is
    re-estimated from each group's rewards. SPO then no longer stops at pi* (success 0.44) but climbs towards
    the highest reward. Measured at 200 steps, seed 0: success 0.91 (no refresh: 0.33 at 200, 0.39 at 600)."""
    torch.set_num_threads(1)
    task = recurrent_drift.CountTask()
    run = recurrent_drift.train_from_stale_sampler(task, centre=True, trust_region=0.2, steps=200,
                                                   record_every=200, refresh_reference_every=50)
    assert run.final.success > run.optimum_success + 0.3
    assert run.final.kl_to_optimum > run.measures[0].kl_to_optimum  # it has left pi* on purpose


def test_after_a_refresh_online_groups_take_q0_from_their_own_rewards_and_only_q0_free_losses_may_refresh():
    from trainer_helpers import Traj

    from megatron_spo.algorithms.spo import q0_from_success
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.online import q0_from_own_groups

    trajs = [Traj("a", [1], [2], r) for r in (0.0, -1.0, -1.0, -1.0)] + [Traj("b", [1], [2], -1.0)]
    trajs += [Traj("a", [1], [2], 0.0, source="offline", q0=-0.7)]
    q0_from_own_groups(trajs, BETA)
    assert [t.q0 for t in trajs[:4]] == [pytest.approx(float(q0_from_success(0.25, BETA)), abs=1e-12)] * 4
    assert trajs[4].q0 == pytest.approx(-1.0) and trajs[5].q0 == -0.7  # offline rows keep theirs
    base = {"init": {"hf": "/x"}, "beta": BETA, "reference_refresh_interval": 10}
    build_config(TrainConfig, dict(base, sources={"online": {}}))  # the default: centred, squared
    build_config(TrainConfig, dict(base, algo="agro"))  # no Q0 in its loss
    with pytest.raises(ConfigError, match=r"reference_refresh_interval: algo spo would train source 'offline' on a "
                       r"Q0 of the first reference.*sources.offline.centre: true.*got centre false, loss squared"):
        build_config(TrainConfig, dict(base, sources={"online": {"loss": "squared"},
                                                      "offline": {"path": "/d", "loss": "squared"}}))
    with pytest.raises(ConfigError, match=r"source 'online'.*got centre true, loss cross_entropy"):
        build_config(TrainConfig, dict(base, sources={"online": {"loss": "cross_entropy"}}))


def test_a_given_coefficient_baseline_is_the_same_centring_and_terminal_coefficients_are_dl_dq():
    """The coefficient_baseline transform with b the leave-one-out mean of terminal_coefficients is exactly
    centre_groups (the trainer takes b over a whole step); squared: c = 2 (Q_T - r)."""
    from megatron_spo.algorithms.groups import centred_on_others
    from megatron_spo.algorithms.spo import cumulative_q, terminal_coefficients

    logp, ref, mask, reward, q0, group = _case(3)
    kw = dict(beta=BETA, objective="terminal", loss="squared")
    c = terminal_coefficients(SPOInputs(logp.detach(), ref, mask, reward, q0), **kw)
    q_t = cumulative_q(logp.detach(), ref, mask, q0, BETA)[:, -1]
    torch.testing.assert_close(c, 2 * (q_t - reward), rtol=0, atol=1e-12)
    spo_loss(SPOInputs(logp, ref, mask, reward, q0, group=group), transforms=[centre_groups], **kw)[0].backward()
    want = logp.grad.clone()
    logp.grad = None
    spo_loss(SPOInputs(logp, ref, mask, reward, q0, coefficient_baseline=c - centred_on_others(c, group)),
             transforms=[coefficient_baseline], **kw)[0].backward()
    torch.testing.assert_close(logp.grad, want, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="centre_groups or coefficient_baseline, not both"):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0, group=group, coefficient_baseline=c),
                 transforms=[centre_groups, coefficient_baseline], **kw)
    with pytest.raises(ValueError, match="objective 'mc' is not a function of Q_T alone"):
        terminal_coefficients(SPOInputs(logp, ref, mask, reward, q0), beta=BETA, objective="mc", loss="squared")


def test_trust_region_drops_the_gradient_of_tokens_already_moved_past_it_in_the_pushed_direction():
    logp, ref, mask, reward, q0, group = _case()
    behaviour = logp.detach().clone()
    behaviour[1, 0] += 0.5  # log(pi / mu) = -0.5 on this token
    behaviour[4, 2] -= 0.5  # +0.5 here
    kw = dict(beta=BETA, objective="terminal", loss="squared")
    loss, m = spo_loss(SPOInputs(logp, ref, mask, reward, q0, behaviour_logp=behaviour),
                       transforms=[partial(trust_region, limit=0.2)], **kw)
    loss.backward()
    clipped = logp.grad.clone()
    logp.grad = None
    spo_loss(SPOInputs(logp, ref, mask, reward, q0), **kw)[0].backward()
    plain = logp.grad
    with torch.no_grad():
        c = 2 * (q0 + BETA * torch.where(mask, logp - ref, 0.0).sum(1) - reward)
    # the token at -0.5 is frozen only if descent lowers it further (c > 0), the one at +0.5 only if c < 0
    frozen = torch.zeros_like(mask)
    frozen[1, 0] = bool(c[1] > 0)
    frozen[4, 2] = bool(c[4] < 0)
    assert int(frozen.sum()) >= 1
    torch.testing.assert_close(clipped, torch.where(frozen, 0.0, plain), rtol=0, atol=1e-12)
    assert m["trust_region_clipped"] == pytest.approx(float(frozen.sum() / mask.sum()))
    with pytest.raises(ValueError, match="trust_region needs a value > 0 and behaviour_logp"):
        spo_loss(SPOInputs(logp, ref, mask, reward, q0), transforms=[partial(trust_region, limit=0.2)], **kw)


def test_centring_and_the_trust_region_are_on_for_online_sources_and_the_config_names_the_field_it_refuses():
    from megatron_spo.config import ConfigError, build_config
    from megatron_spo.experiments.quickstart import QuickstartTrainConfig
    from megatron_spo.training.config import SourceConfig

    # unset: centred inside the default trust region on the online source only, and only where the loss allows
    assert SourceConfig().centred("online") and SourceConfig().clip("online") == 0.2
    assert not SourceConfig().centred("offline") and SourceConfig().clip("offline") is None
    assert SourceConfig(centre=True).centred("offline") and SourceConfig(trust_region=0.1).clip("offline") == 0.1
    assert SourceConfig(trust_region=0).clip("online") is None and not SourceConfig(centre=False).centred("online")
    assert not SourceConfig(objective="mc").centred("online") and SourceConfig(objective="mc").clip("online") is None
    assert QuickstartTrainConfig().centre is True
    # the loss that holds at pi* on every check (the network reproduction: cross_entropy does not)
    assert SourceConfig().loss == QuickstartTrainConfig().loss == "squared"
    for field, value in (("centre", True), ("trust_region", 0.2)):
        with pytest.raises(ConfigError, match=f"{field}: needs objective terminal or advantage, not 'mc'"):
            build_config(SourceConfig, {"objective": "mc", field: value}, "sources.mc")


def test_the_quickstart_trains_its_online_source_centred_inside_a_trust_region_only_where_spo_can(tmp_path):
    """The quickstart's defaults for online SPO (docs/spo-stability.md): centred coefficient, trust region 0.2,
    lr 3e-5 and beta 1/log(1e5) (AGRO alike; GRPO: lr 3e-5, beta 0; TRL's GRPO: lr 1e-4; PPO: lr 1e-4, beta
    0.5); the trust region reaches sources.online only for SPO with a terminal / advantage objective (the config
    refuses it elsewhere), and `train.trust_region=null` turns it off."""
    from megatron_spo.config import ConfigError, apply_overrides, build_config
    from megatron_spo.experiments.quickstart import (
        PAPER_BETA_ALGOS,
        QUICKSTART_LRS,
        QuickstartConfig,
        train_config,
    )
    from megatron_spo.training.algos import names

    endpoints = type("E", (), {"router_url": "http://127.0.0.1:1", "engine_urls": ["http://127.0.0.1:2"]})()

    def online(*overrides):
        cfg = build_config(QuickstartConfig, apply_overrides({}, list(overrides)), "quickstart")
        tcfg = train_config(cfg, tmp_path, tmp_path / "ref", tmp_path / "init", endpoints, tmp_path / "q0.jsonl",
                            None)
        src = tcfg.sources["online"]
        return src.centred("online"), src.clip("online"), tcfg.optimizer.lr, tcfg.beta

    assert online() == (True, 0.2, 3e-5, PAPER_BETA)
    assert online("train.online_fraction=1.0", "train.trust_region=0.1") == (True, 0.1, 3e-5, PAPER_BETA)
    assert online("train.trust_region=null", "train.centre=false") == (False, None, 3e-5, PAPER_BETA)
    assert online("train.lr=1e-4", "train.beta=0.5")[2:] == (1e-4, 0.5)
    assert online("algo=ppo")[2:] == (1e-4, 0.5)
    assert online("algo=agro")[2:] == (3e-5, PAPER_BETA)
    assert online("algo=grpo")[2:] == (3e-5, 0.0)
    assert online("algo=grpo", "train.lr=1e-4")[2:] == (1e-4, 0.0)
    trl = build_config(QuickstartConfig, {"trainer": "trl", "algo": "grpo"}, "quickstart").train
    assert (trl.lr, trl.beta) == (1e-4, 0.0)  # TRL's GRPOTrainer: its own sweep's lr, not ours
    assert {a for _, a in QUICKSTART_LRS} | set(PAPER_BETA_ALGOS) <= set(names())  # a renamed one would fall back
    assert {t for t, _ in QUICKSTART_LRS} <= set(QuickstartConfig.model_fields["trainer"].annotation.__args__)
    assert online("train.trust_region=0")[1] is None
    assert online("train.objective=mc")[:2] == (False, None)
    assert online("algo=grpo")[1] is None
    refresh = ["train.online_fraction=1.0", "train.reference_refresh_interval=30"]
    tcfg = train_config(build_config(QuickstartConfig, apply_overrides({}, refresh)), tmp_path, tmp_path / "ref",
                        tmp_path / "init", endpoints, tmp_path / "q0.jsonl", None)
    assert tcfg.reference_refresh_interval == 30
    # every rule of the trainer's config is checked when the quickstart's is built, before any model is
    with pytest.raises(ConfigError, match=r"^quickstart: the trainer would refuse this run .*: reference_refresh_"
                       r"interval: algo spo would train source 'offline' on a Q0 of the first reference.*got centre "
                       r"false, loss squared\)$"):
        build_config(QuickstartConfig, {"train": {"reference_refresh_interval": 30}}, "quickstart")
    with pytest.raises(ConfigError, match=r"source 'online' .*got centre true, loss cross_entropy\)$"):
        build_config(QuickstartConfig, apply_overrides({}, refresh + ["train.loss=cross_entropy"]), "quickstart")


def test_policy_gradient_term_adds_the_leave_one_out_reinforce_gradient():
    logp, ref, mask, reward, q0, group = _case()
    kw = dict(beta=BETA, objective="terminal", loss="squared")
    inputs = SPOInputs(logp, ref, mask, reward, q0, group=group)
    spo_loss(inputs, transforms=[centre_groups, partial(policy_gradient, coef=0.5)], **kw)[0].backward()
    with_pg = logp.grad.clone()
    logp.grad = None
    spo_loss(inputs, transforms=[centre_groups], **kw)[0].backward()
    others = torch.stack([reward[(group == group[i]) & (torch.arange(6) != i)].mean() for i in range(6)])
    expected = -0.5 * ((reward - others) / 6).unsqueeze(1) * mask
    torch.testing.assert_close(with_pg - logp.grad, expected, rtol=0, atol=1e-12)
