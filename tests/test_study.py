"""`megatron-spo compare`: the statistics, the report's numbers and verdicts from known runs, resumability, and the
errors for bad study settings. (The runs themselves are quickstarts, proven in test_quickstart.py.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from megatron_spo.config import ConfigError, apply_overrides, build_config
from megatron_spo.experiments import study as st
from megatron_spo.experiments.quickstart import QuickstartConfig, split_problems
from megatron_spo.experiments.study_report import two_way_bootstrap, write_report

PROBLEMS = [f"p{i}" for i in range(40)]


def test_two_way_bootstrap_exact_cases():
    assert two_way_bootstrap([[0.25] * 5] * 3) == (0.25, 0.25, 0.25)  # no spread: the interval is the point
    mean, lo, hi = two_way_bootstrap([[1.0, 0.0] * 20] * 3)
    assert mean == 0.5 and lo < 0.5 < hi
    # seed-to-seed spread widens the interval beyond what the problems alone give
    rng = random.Random(0)
    base = [rng.random() for _ in range(40)]
    within = two_way_bootstrap([base] * 3)
    across = two_way_bootstrap([[b + off for b in base] for off in (-0.2, 0.0, 0.2)])
    assert across[0] == pytest.approx(within[0]) and (across[2] - across[1]) > 1.5 * (within[2] - within[1])


def _fake_reference(root: Path, seed: int) -> None:
    """The reference's evaluation a seed's runs share: pass@1 0.2, pass@10 0.6, one distinct correct program."""
    shared = root / "shared" / f"seed{seed}"
    shared.mkdir(parents=True)
    before = [{"prompt_id": p, "n": 20, "correct": 0, "pass@1": 0.2, "pass@10": 0.6, "tests": {},
               "distinct_correct": 1} for p in PROBLEMS]
    (shared / "eval_before.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before))


def _fake_run(root: Path, study: st.StudyConfig, arm: str, seed: int, p1: float, p10: float, *, pushes: int,
              wall: float, kind: str = "runs", settings=(), grad=(1.0, 1.0), distinct: int = 2) -> None:
    run = st.RunSpec(kind, arm, seed, settings).run_dir(root)
    (run / "train").mkdir(parents=True)
    recs = [{"prompt_id": p, "n": 20, "correct": 0, "pass@1": p1, "pass@10": p10, "tests": {},
             "distinct_correct": distinct} for p in PROBLEMS]
    (run / "eval_after.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "results.json").write_text(json.dumps({"wall_s": {"train": wall}, "weight_pushes": pushes,
                                                  "pass@1": {"after": p1}}))
    steps = 9
    metrics = [{"step": i + 1, "time": 1000.0 + 10 * i, "time/step": 10.0, "reward/online": -0.5 + 0.05 * i,
                "samples/online": 16.0, "grad_norm": grad[0] if i < 3 else grad[1], "mean_seq_log_ratio": 0.1 * i,
                "weight_sync/bytes": 1e8 if pushes and (i + 1) % (steps // pushes) == 0 else 0.0,
                "memory/peak_rss_gb": 1.5, "policy_version": 0.0} for i in range(steps)]
    (run / "train" / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_report_numbers_and_verdicts_from_known_runs(tmp_path):
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path),
                                          "arms": ["spo", "spo-online", "ppo", "grpo", "trl-grpo"],
                                          "seeds": [0, 1], "sweep": {"enabled": False},
                                          "long_run": {"seeds": [0, 1], "arms": ["spo", "spo-online", "grpo", "ppo"]}})
    for seed in (0, 1):
        _fake_reference(tmp_path, seed)
        _fake_run(tmp_path, study, "spo", seed, 0.4, 0.9, pushes=1, wall=90, distinct=3)
        _fake_run(tmp_path, study, "spo-online", seed, 0.3, 0.9, pushes=1, wall=80)
        _fake_run(tmp_path, study, "ppo", seed, 0.25, 0.6, pushes=9, wall=120)
        _fake_run(tmp_path, study, "grpo", seed, 0.4, 0.7, pushes=9, wall=100)
        _fake_run(tmp_path, study, "trl-grpo", seed, 0.35, 0.7, pushes=0, wall=100)
    # 3x the steps: SPO gains 0.05 pass@1 and keeps pass@10, GRPO loses 0.05 and 0.1
    for arm, seed, grad, p1, p10 in (("spo", 0, (1.0, 2.0), 0.45, 0.9), ("spo", 1, (1.0, 4.0), 0.45, 0.9),
                                     ("grpo", 0, (1.0, 4.0), 0.35, 0.6), ("grpo", 1, (1.0, 4.0), 0.35, 0.6)):
        _fake_run(tmp_path, study, arm, seed, p1, p10, pushes=3, wall=300, kind="long", grad=grad,
                  settings=(("train.steps", 270),))
    # online-only SPO decays at 3x on seed 0 (seed 1 never ran); PPO's seed 1 diverged
    _fake_run(tmp_path, study, "spo-online", 0, 0.2, 0.8, pushes=3, wall=300, kind="long", settings=(("train.steps", 270),))
    _fake_run(tmp_path, study, "ppo", 0, 0.25, 0.6, pushes=9, wall=300, kind="long", settings=(("train.steps", 270),))
    diverged = st.RunSpec("long", "ppo", 1, (("train.steps", 270),)).run_dir(tmp_path).parent
    diverged.mkdir(parents=True)
    (diverged / "FAILED").write_text("TrainingDiverged: step 200: |mean seq log-ratio| 60 > 50 | see the log\n")
    report = write_report(study, tmp_path, {a: {"settings": {}} for a in study.arms}).read_text()

    # trained vs reference: every problem moved by the same amount, so the interval is the point
    assert "| spo | 2 x 40 | 0.400 | +0.200 [+0.200, +0.200] | 0.900 | +0.300 [+0.300, +0.300] | 0.500 | 3.00 |" in report
    assert "| reference | 2 x 40 | 0.200 | | 0.600 | | 0.400 | 1.00 |" in report
    # resources: pushes, GB pushed (1e8 bytes per push), peak RSS
    assert "| 90 ± 0 | 1 ± 0 | 0.10 ± 0.00 | 1.50 ± 0.00 |" in report
    assert "| 120 ± 0 | 9 ± 0 | 0.90 ± 0.00 | 1.50 ± 0.00 |" in report
    # SPO minus each arm
    assert "| ppo | +0.150 [+0.150, +0.150] | +0.300 [+0.300, +0.300] | +0.150 [+0.150, +0.150] |" in report
    # our GRPO against TRL's: pass@1 differs by exactly 0.05, so not within noise
    assert "| +0.050 [+0.050, +0.050] | +0.000 [+0.000, +0.000] | -0.050 [-0.050, -0.050] | +0.000 [+0.000, +0.000] " \
           "| no (pass@1, pass@10) |" in report
    # the paper's claims, each with its verdict
    assert "| 1. SPO beats PPO on pass@10 | spo - ppo, pass@10: +0.300 [+0.300, +0.300] (2 seeds x 40 problems) | " \
           "reproduced |" in report
    assert "2b. ... and than GRPO | spo - grpo, gap: +0.200" in report
    assert "3. SPO benefits from offline data | spo - spo-online, pass@1: +0.100 [+0.100, +0.100] (2 seeds x 40 " \
           "problems) | reproduced |" in report
    assert "3b. ... on pass@10 | spo - spo-online, pass@10: +0.000 [+0.000, +0.000]" in report
    assert "inconclusive (CI includes 0)" in report
    assert "train wall SPO / PPO per seed 0.75, 0.75; pushes 1 ± 0 vs 9 ± 0" in report and "| reproduced |" in report
    # long runs: each arm's change from 1x to 3x, SPO's minus GRPO's, paired per (seed, problem); growth averaged
    # over the seeds (SPO (2 + 4) / 2)
    assert "| 5. SPO is more stable (long runs, 3x steps, 2 seeds) | (3x - 1x) SPO minus (3x - 1x) grpo: pass@1 " \
           "+0.100 [+0.100, +0.100], pass@10 +0.100 [+0.100, +0.100]; held-out pass@1 1x -> 3x SPO 0.400 -> 0.450, " \
           "grpo 0.400 -> 0.350; grad-norm growth (last / first third) 3.00 vs 4.00 | reproduced |" in report
    # long runs against the same seeds' 1x runs and the reference, with a verdict per arm
    assert "| spo | 2 x 40 | 0.400 -> 0.450 | +0.050 [+0.050, +0.050] | 0.900 -> 0.900 | +0.000 [+0.000, +0.000] | " \
           "+0.300 [+0.300, +0.300] | 3.00 | 0.80 | none | holds |" in report
    assert "| grpo | 2 x 40 | 0.400 -> 0.350 | -0.050 [-0.050, -0.050] | 0.700 -> 0.600 | -0.100 [-0.100, -0.100] | " \
           "+0.000 [+0.000, +0.000] | 4.00 | 0.80 | none | decays |" in report
    assert "| spo-online | 1 x 40 | 0.300 -> 0.200 | -0.100 [-0.100, -0.100] | 0.900 -> 0.800 | -0.100 " \
           "[-0.100, -0.100] | +0.200 [+0.200, +0.200] | 1.00 | 0.80 | none | decays |" in report
    assert "| ppo | 1 x 40 | 0.250 -> 0.250 | +0.000 [+0.000, +0.000] | 0.600 -> 0.600 | +0.000 [+0.000, +0.000] | " \
           "+0.000 [+0.000, +0.000] | 1.00 | 0.80 | seed 1: TrainingDiverged: step 200: /mean seq log-ratio/ 60 > 50 / " \
           "see the log | fails |" in report
    for png in ("pass_at_k", "learning_curve_rollouts", "learning_curve_seconds", "stability"):
        assert (tmp_path / f"{png}.png").stat().st_size > 1000 and f"]({png}.png)" in report
    # every table row has its header's cells (a '|' inside a measurement split claim 5's row)
    for table in [b for b in report.split("\n\n") if b.lstrip().startswith("|")]:
        rows = [r for r in table.strip().splitlines() if r.startswith("|")]
        assert {r.count("|") for r in rows} == {rows[0].count("|")}, table


def test_the_lora_arm_trains_adapters_and_its_report_gives_push_bytes_and_memory(tmp_path):
    """Issue 46: the spo-lora arm reaches the quickstart with train.lora at its defaults (an empty {} survives the
    flattening into overrides) and 10x SPO's lr; the report sets it beside full SPO, paired, with MB per push and
    trainer peak RSS."""
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path), "arms": ["spo", "spo-lora"], "seeds": [0, 1],
                                          "sweep": {"enabled": False}, "long_run": {"seeds": []}})
    args = st.quickstart_overrides(study, st.RunSpec("runs", "spo-lora", 0, ()), tmp_path)
    assert "train.lora={}" in args
    cfg = build_config(QuickstartConfig, apply_overrides({}, args))
    assert cfg.train.lora is not None and cfg.train.lora.rank == 8 and cfg.train.lr == pytest.approx(3e-4)
    assert cfg.algo == "spo" and cfg.train.beta == build_config(QuickstartConfig, {}).train.beta
    assert build_config(QuickstartConfig, apply_overrides({}, st.quickstart_overrides(
        study, st.RunSpec("runs", "spo", 0, ()), tmp_path))).train.lora is None
    for seed in (0, 1):
        _fake_reference(tmp_path, seed)
        _fake_run(tmp_path, study, "spo", seed, 0.4, 0.9, pushes=1, wall=90)
        _fake_run(tmp_path, study, "spo-lora", seed, 0.35, 0.9, pushes=3, wall=80)
    lora = st.RunSpec("runs", "spo-lora", 1, ()).run_dir(tmp_path) / "train" / "metrics.jsonl"
    lora.write_text(lora.read_text().replace('"weight_sync/bytes": 100000000.0', '"weight_sync/bytes": 250000.0')
                    .replace('"memory/peak_rss_gb": 1.5', '"memory/peak_rss_gb": 1.1'))
    report = write_report(study, tmp_path, study.fixed_settings()).read_text()
    assert "## LoRA against full SPO (spo-lora minus spo, paired per seed and problem)" in report
    assert "| spo | 2 x 40 | 0.400 | 0.900 | | | 1 ± 0 | 100.000 ± 0.000 | 1.500 ± 0.000 |" in report
    assert "| spo-lora | 2 x 40 | 0.350 | 0.900 | -0.050 [-0.050, -0.050] | +0.000 [+0.000, +0.000] | 3 ± 0 | " \
           "50.125 ± 70.534 | 1.300 ± 0.283 |" in report
    assert "at lr 3e-4, 10x full SPO's 3e-5" in report


def test_finished_runs_are_skipped_and_failures_named(tmp_path, monkeypatch):
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path), "arms": ["spo"]})
    spec = st.RunSpec("runs", "spo", 0, (("train.lr", 2e-4),))
    run = spec.run_dir(tmp_path)
    run.mkdir(parents=True)
    (run / "results.json").write_text('{"pass@1": {"after": 0.5}}')

    def no_subprocess(*a, **k):
        raise AssertionError("a finished run was started again")

    monkeypatch.setattr(st.subprocess, "run", no_subprocess)
    assert st.run_one(study, spec, tmp_path, print) == {"pass@1": {"after": 0.5}}

    class Failed:
        returncode = 3

    def diverging(*a, stdout, **k):
        stdout.write("[rank0]: Traceback\n[rank0]: megatron_spo.training.trainer.TrainingDiverged: step 86: "
                     "mean sequence log(pi/pi_0) = 51\nshutting down\n")
        return Failed()

    monkeypatch.setattr(st.subprocess, "run", diverging)
    said = []
    failed = st.RunSpec("runs", "spo", 1, ())
    assert st.run_one(study, failed, tmp_path, said.append) is None
    assert said == [f"FAILED runs spo default seed 1 after 0 s (exit 3): see "
                    f"{tmp_path / 'runs' / 'spo' / 'default_seed1' / 'quickstart.log'}"]
    why = "megatron_spo.training.trainer.TrainingDiverged: step 86: mean sequence log(pi/pi_0) = 51"
    assert st.failure(failed, tmp_path) == why
    from megatron_spo.experiments.study_report import _score

    assert _score({"validation": None, "failure": why}) == "diverged (step 86)"
    # a failed run is not started again (its settings diverge), unless asked
    monkeypatch.setattr(st.subprocess, "run", no_subprocess)
    assert st.run_one(study, failed, tmp_path, said.append) is None and len(said) == 1
    retry = study.model_copy(update={"retry_failed": True})
    monkeypatch.setattr(st.subprocess, "run", diverging)
    assert st.run_one(retry, failed, tmp_path, said.append) is None and len(said) == 2

    class Finished:
        returncode = 0

    def finishing(*a, stdout, **k):  # a retry that succeeds (a slow machine's failure, say): no FAILED left behind
        (failed.run_dir(tmp_path) / "results.json").write_text('{"pass@1": {"after": 0.25}}')
        return Finished()

    monkeypatch.setattr(st.subprocess, "run", finishing)
    failed.run_dir(tmp_path).mkdir(parents=True, exist_ok=True)
    assert st.run_one(retry, failed, tmp_path, said.append) == {"pass@1": {"after": 0.25}}
    assert st.failure(failed, tmp_path) is None and not (failed.run_dir(tmp_path).parent / "FAILED").exists()


def test_sweep_and_test_runs_share_the_seed_but_not_the_split(tmp_path):
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path), "quickstart": {"train": {"steps": 30}}})
    grid = st.sweep_grid(study, "grpo")
    assert grid[:2] == [(("train.lr", 1e-5), ("train.beta", 0.0)), (("train.lr", 1e-5), ("train.beta", 0.04))]
    assert len(grid) == 8 and len(st.sweep_grid(study, "ppo")) == 8
    assert len(st.sweep_grid(study, "spo")) == 12  # beta 1/log(1e5) (the paper's), 0.5, 1
    # LoRA's arm sweeps 10x the learning rates (its fixed lr 3e-4 holds only without a sweep, which overrides it)
    lora_lrs = sorted({dict(g)["train.lr"] for g in st.sweep_grid(study, "spo-lora")})
    assert lora_lrs == pytest.approx([10 * lr for lr in study.sweep.lrs]) and 3e-4 in lora_lrs
    lora = apply_overrides({}, st.quickstart_overrides(study, st.RunSpec("sweep", "spo-lora", 0, st.sweep_grid(
        study, "spo-lora")[0]), tmp_path))
    assert lora["train"]["lr"] == pytest.approx(1e-4) and lora["train"]["lora"] == {}
    sweep = apply_overrides({}, st.quickstart_overrides(study, st.RunSpec("sweep", "spo-online", 0, grid[0][:1]), tmp_path))
    test = apply_overrides({}, st.quickstart_overrides(study, st.RunSpec("runs", "spo-online", 0, ()), tmp_path))
    assert sweep["eval_splits"] == ["validation"] and test["eval_splits"] == ["heldout"]
    assert sweep["reuse_dir"] == test["reuse_dir"] == str(tmp_path / "shared" / "seed0")
    assert sweep["validation_problems"] == test["validation_problems"] == 30  # same training problems
    assert sweep["train"] == {"steps": 30, "online_fraction": 1.0, "lr": 1e-5} and sweep["algo"] == "spo"
    cfg = build_config(QuickstartConfig, test)
    from megatron_spo.experiments.reference_model import task_from_config

    split = split_problems(cfg, task_from_config(cfg.reference))
    ids = {role: {p.id for p in ps} for role, ps in split.items()}
    assert len(split["train"]) == 90 and split["validation"] == [] and len(split["heldout"]) == 120
    val = split_problems(build_config(QuickstartConfig, sweep), task_from_config(cfg.reference))
    assert len(val["validation"]) == 30 and {p.id for p in val["train"]} == ids["train"]
    assert val["held_out_validation"] == val["validation"] == split["held_out_validation"]  # evaluated or not
    assert not ({p.id for p in val["validation"]} & (ids["train"] | ids["heldout"]))
    # the trainer's own prompt set (its task config) is those 90 problems: the validation ones stay out of
    # training (they did not, and a sweep's every SPO run stopped on their missing Q0)
    from types import SimpleNamespace

    from megatron_spo.data.problems import problems_from_task_config
    from megatron_spo.experiments.quickstart import train_config

    fleet = SimpleNamespace(router_url="http://127.0.0.1:1", engine_urls=["http://127.0.0.1:2"] * 2)
    tcfg = train_config(build_config(QuickstartConfig, sweep), tmp_path, tmp_path / "ref", tmp_path / "init", fleet,
                        tmp_path / "q0.jsonl", tmp_path / "offline.jsonl", len(val["train"]))
    assert [p.id for p in problems_from_task_config(tcfg.task)] == [p.id for p in val["train"]]


def test_bad_study_settings_fail_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"compare: arms: unknown arm\(s\) \['sac'\]; arms are"):
        build_config(st.StudyConfig, {"arms": ["spo", "sac"]}, "compare")
    with pytest.raises(ConfigError, match=r"sweep.coefficients: unknown arm\(s\) \['dpo'\]"):
        build_config(st.StudyConfig, {"sweep": {"coefficients": {"dpo": [1.0]}}}, "compare")
    study = build_config(st.StudyConfig, {"quickstart": {"train": {"stepz": 3}}})
    with pytest.raises(ConfigError, match=r"compare: arm spo: train.stepz: unknown field"):
        st._check_quickstart(study)
    with pytest.raises(ConfigError, match="trainer 'trl' runs TRL's GRPOTrainer: it needs algo=grpo, not 'spo'"):
        build_config(QuickstartConfig, {"trainer": "trl"})
    with pytest.raises(ConfigError, match=r"eval_splits \['validation'\] with validation_problems 0: nothing"):
        build_config(QuickstartConfig, {"eval_splits": ["validation"]})
    cfg = build_config(QuickstartConfig, {"validation_problems": 120})
    from megatron_spo.experiments.reference_model import task_from_config

    with pytest.raises(ConfigError, match="validation_problems 120 leaves nothing to train on .the task has 120"):
        split_problems(cfg, task_from_config(cfg.reference))


def test_the_sweep_chooses_the_best_validation_score_and_ablations_inherit(tmp_path, monkeypatch):
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path), "arms": ["spo-online", "spo", "grpo"],
                                          "sweep": {"coefficients": {"spo": [], "grpo": [0.0, 0.04]},
                                                    "lrs": [1e-4, 2e-4, 4e-4], "inherit": {"spo-online": "spo"}}})
    scores = {"spo": [0.30, 0.35, 0.20], "grpo": [0.1, 0.2, 0.3, 0.3, 0.25, 0.05]}  # grpo: a tie, the first wins
    for arm, values in scores.items():
        for settings, score in zip(st.sweep_grid(study, arm), values):
            run = st.RunSpec("sweep", arm, 0, settings).run_dir(tmp_path)
            run.mkdir(parents=True)
            (run / "results.json").write_text(json.dumps({"validation": {"pass@1": {"after": score}}}))
    monkeypatch.setattr(st.subprocess, "run", lambda *a, **k: pytest.fail("every sweep run is finished"))
    chosen = st.choose(study, tmp_path, print)
    assert chosen["spo"]["settings"] == {"train.lr": 2e-4}
    assert chosen["grpo"]["settings"] == {"train.lr": 2e-4, "train.beta": 0.0}
    assert chosen["spo-online"]["settings"] == {"train.lr": 2e-4} and chosen["spo-online"]["inherited_from"] == "spo"
    assert [g["validation"] for g in chosen["grpo"]["grid"]] == scores["grpo"]


def test_the_sweep_names_the_points_its_validation_problems_cannot_separate_from_the_choice(tmp_path, monkeypatch):
    """One paired standard error over the validation problems: a point that close to the best is listed beside
    the choice (the sweep cannot rank them); a point further away, or one without per-problem scores, is not."""
    assert st.paired_gap({"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.5}, {"a": 1.0, "b": 0.5, "c": 0.0, "d": 0.5}) == (
        0.125, 0.125)  # differences 0, 0.5, 0, 0: mean 1/8, sd 1/4, se 1/4 / sqrt(4)
    assert st.paired_gap({"a": 1.0}, {"b": 1.0}) == pytest.approx((float("nan"),) * 2, nan_ok=True)
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path), "arms": ["grpo"],
                                          "sweep": {"coefficients": {"grpo": [0.0]}, "lrs": [1e-5, 3e-5, 1e-4, 3e-4]}})
    per_problem = {1e-5: [0.9, 0.6, 0.3, 0.2], 3e-5: [1.0, 0.8, 0.4, 0.2], 1e-4: [0.1, 0.2, 0.1, 0.0], 3e-4: None}
    for settings, scores in zip(st.sweep_grid(study, "grpo"), per_problem.values()):
        run = st.RunSpec("sweep", "grpo", 0, settings).run_dir(tmp_path)
        run.mkdir(parents=True)
        mean = sum(scores) / 4 if scores else 0.65  # 3e-4: the best mean, read from results.json alone
        (run / "results.json").write_text(json.dumps({"validation": {"pass@1": {"after": mean}}}))
        if scores:
            (run / "eval_validation_after.jsonl").write_text("".join(
                json.dumps({"prompt_id": f"v{i}", "pass@1": x}) + "\n" for i, x in enumerate(scores)))
    monkeypatch.setattr(st.subprocess, "run", lambda *a, **k: pytest.fail("every sweep run is finished"))
    # the best mean (3e-4) kept no per-problem file: nothing can be said of the others' gaps
    chosen = st.choose(study, tmp_path, print)
    assert chosen["grpo"]["settings"]["train.lr"] == 3e-4 and chosen["grpo"]["not_separated"] == []
    assert all(g["gap_se"] is None for g in chosen["grpo"]["grid"])
    (st.RunSpec("sweep", "grpo", 0, st.sweep_grid(study, "grpo")[3]).run_dir(tmp_path) / "results.json").unlink()
    (st.RunSpec("sweep", "grpo", 0, st.sweep_grid(study, "grpo")[3]).run_dir(tmp_path).parent / "FAILED").write_text(
        "megatron_spo.training.trainer.TrainingDiverged: step 9: mean sequence log(pi/pi_0) = 51\n")
    chosen = st.choose(study, tmp_path, print)
    grid = chosen["grpo"]["grid"]
    assert chosen["grpo"]["settings"] == {"train.lr": 3e-5, "train.beta": 0.0}  # mean 0.6
    # 1e-5: differences 0.1, 0.2, 0.1, 0 (mean 0.1, se 0.0408) -> separated; 1e-4: mean 0.5 -> separated
    assert grid[0]["gap"] == pytest.approx(0.1) and grid[0]["gap_se"] == pytest.approx((0.02 / 3) ** 0.5 / 2)
    assert chosen["grpo"]["not_separated"] == []
    (st.RunSpec("sweep", "grpo", 0, st.sweep_grid(study, "grpo")[0]).run_dir(tmp_path) / "eval_validation_after.jsonl"
     ).write_text("".join(json.dumps({"prompt_id": f"v{i}", "pass@1": x}) + "\n" for i, x in enumerate([0.6, 0.8, 0.4, 0.4])))
    chosen = st.choose(study, tmp_path, print)  # 1e-5 now: differences 0.4, 0, 0, -0.2 (mean 0.05, se 0.13)
    assert chosen["grpo"]["not_separated"] == [{"train.lr": 1e-5, "train.beta": 0.0}]
    _fake_reference(tmp_path, 0)
    _fake_run(tmp_path, study, "grpo", 0, 0.5, 0.7, pushes=9, wall=100, settings=tuple(chosen["grpo"]["settings"].items()))
    report = write_report(study, tmp_path, chosen).read_text()
    assert "| train.lr = 3e-05, train.beta = 0 (not separated from: lr 1e-05, beta 0) |" in report
    assert "lr 0.0003, beta 0 -> diverged (step 9)" in report
    bad = st.RunSpec("sweep", "grpo", 0, st.sweep_grid(study, "grpo")[2]).run_dir(tmp_path) / "eval_validation_after.jsonl"
    bad.write_text('{"prompt_id": "v0", "pass@1": 0.1}\n{"prompt_id": "v1", "pass@1"')  # a truncated row
    with pytest.raises(ValueError, match=rf"compare: {bad}:2: not a per-problem evaluation row with prompt_id and "
                                         r"pass@1 \(JSONDecodeError"):
        st.choose(study, tmp_path, print)


def test_without_a_sweep_each_arm_runs_at_its_given_settings_and_the_report_says_which(tmp_path):
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path), "arms": ["spo", "ppo", "grpo-tis"],
                                          "sweep": {"enabled": False}, "seeds": [0],
                                          "settings": {"ppo": {"train.lr": 3e-5, "train.beta": 0.05}}})
    chosen = study.fixed_settings()
    assert chosen == {"spo": {"settings": {}}, "ppo": {"settings": {"train.lr": 3e-5, "train.beta": 0.05}},
                      "grpo-tis": {"settings": {}}}
    run = apply_overrides({}, st.quickstart_overrides(
        study, st.RunSpec("runs", "ppo", 1, tuple(chosen["ppo"]["settings"].items())), tmp_path))
    assert run["train"] == {"lr": 3e-5, "beta": 0.05} and run["validation_problems"] == 0 and run["seed"] == 1
    resumed = study.model_copy(update={"validation_held_out": True})  # settings from an earlier sweep: its problems
    assert apply_overrides({}, st.quickstart_overrides(resumed, st.RunSpec("runs", "ppo", 1, ()), tmp_path))[
        "validation_problems"] == 30
    from megatron_spo.experiments.study_report import write_report

    _fake_reference(tmp_path, 0)
    _fake_run(tmp_path, study, "spo", 0, 0.5, 0.8, pushes=9, wall=100)
    _fake_run(tmp_path, study, "grpo-tis", 0, 0.5, 0.7, pushes=9, wall=100)
    report = write_report(study, tmp_path, chosen).read_text()
    assert "| ppo | train.lr = 3e-05, train.beta = 0.05 |" in report
    assert "| 2b. ... and than GRPO | spo - grpo-tis, gap: +0.100 [+0.100, +0.100] (1 seed x 40 problems)" in report
    assert "| spo | the quickstart's defaults |" in report
    with pytest.raises(ConfigError, match=r"compare: settings: unknown arm\(s\) \['dpo'\]"):
        build_config(st.StudyConfig, {"settings": {"dpo": {"train.lr": 1e-4}}}, "compare")


def test_arms_of_one_seed_at_other_betas_get_the_shared_samples_with_their_own_q0(tmp_path):
    """The study shares one seed's Q0 log and correct reference samples among arms; an arm at another beta must
    train on Q0 at its own beta (offline samples included), not the beta of the arm that sampled them."""
    from megatron_spo.data.q0 import q0_from_counts
    from megatron_spo.data.trajectory import Trajectory, read_jsonl, write_jsonl
    from megatron_spo.experiments.quickstart import build_offline_set

    sampled_at = q0_from_counts(3, 12, 0.5)
    write_jsonl([Trajectory(prompt_id="num-001", prompt_tokens=[1, 2], response_tokens=[3, 4], reward=0.0,
                            source="reference", policy_version=0, q0=sampled_at.q0)], tmp_path / "shared.jsonl")
    mine = q0_from_counts(3, 12, 1.0)
    n_samples, n_human = build_offline_set(tmp_path / "shared.jsonl", tmp_path / "offline.jsonl", [],
                                           {"num-001": mine}, None, 0)
    (kept,), _ = read_jsonl(tmp_path / "offline.jsonl")
    assert (n_samples, n_human) == (1, 0)
    assert kept.q0 == pytest.approx(mine.q0) and kept.q0 != pytest.approx(sampled_at.q0)


def test_wall_clock_ratios_pair_runs_by_seed(tmp_path):
    """A study stopped part way has arms at different seeds: SPO / PPO wall times are paired by seed."""
    study = build_config(st.StudyConfig, {"out_dir": str(tmp_path), "arms": ["spo", "ppo"], "seeds": [0, 1],
                                          "sweep": {"enabled": False}})
    for seed in (0, 1):
        _fake_reference(tmp_path, seed)
    _fake_run(tmp_path, study, "spo", 0, 0.4, 0.9, pushes=1, wall=50)
    _fake_run(tmp_path, study, "spo", 1, 0.4, 0.9, pushes=1, wall=90)
    _fake_run(tmp_path, study, "ppo", 1, 0.3, 0.8, pushes=9, wall=100)  # seed 0 of PPO never finished
    report = write_report(study, tmp_path, {a: {"settings": {}} for a in study.arms}).read_text()
    assert "train wall SPO / PPO per seed 0.90;" in report


def test_an_archive_rewrites_the_same_report_and_resumes_without_rerunning(tmp_path, monkeypatch):
    """compare --archive keeps what the report reads (tens of KB a run, not the checkpoints): the report written
    from the archive is the study's own, and compare there reruns nothing finished."""
    from megatron_spo.experiments.study_report import archive, write_report

    root, dest = tmp_path / "study", tmp_path / "archive"
    study = build_config(st.StudyConfig, {"out_dir": str(root), "arms": ["spo", "ppo"], "seeds": [0, 1],
                                          "sweep": {"enabled": False},
                                          "long_run": {"seeds": [0], "arms": ["spo", "ppo"]}})
    (root).mkdir()
    (root / "study.json").write_text(study.model_dump_json())
    for seed in (0, 1):
        _fake_reference(root, seed)
        _fake_run(root, study, "spo", seed, 0.4 + 0.05 * seed, 0.9, pushes=1, wall=90, distinct=3)
        _fake_run(root, study, "ppo", seed, 0.3, 0.7 - 0.1 * seed, pushes=9, wall=120)
    _fake_run(root, study, "spo", 0, 0.45, 0.9, pushes=3, wall=300, kind="long", settings=(("train.steps", 270),))
    stamp = '{"cache_key": "abc", "sha256": "' + "e" * 64 + '"}\n'  # the reference the runs started from
    (root / "shared" / "seed0" / "reference.json").write_text(stamp)
    failed = st.RunSpec("long", "ppo", 0, (("train.steps", 270),)).run_dir(root).parent
    failed.mkdir(parents=True)
    (failed / "FAILED").write_text("TrainingDiverged: step 200\n")
    run = st.RunSpec("runs", "spo", 0, ()).run_dir(root)
    (run / "train" / "checkpoints").mkdir()
    (run / "train" / "checkpoints" / "model.pt").write_bytes(b"\0" * 2_000_000)  # never archived
    with (run / "train" / "metrics.jsonl").open("a") as f:  # a metric the report does not read is dropped
        f.write(json.dumps({"step": 10, "time": 1100.0, "grad_norm": 1.0, "loss/online": 0.3}) + "\n")
    chosen = {a: {"settings": {}} for a in study.arms}
    want = write_report(study, root, chosen).read_text()

    done = archive(root, dest)
    assert done["runs"] == 5 and done["bytes"] < 60_000
    assert not (dest / "runs" / "spo" / "default_seed0" / "spo" / "train" / "checkpoints").exists()
    assert (dest / "long" / "ppo" / "steps270_seed0" / "FAILED").read_text() == "TrainingDiverged: step 200\n"
    assert (dest / "shared" / "seed0" / "reference.json").read_text() == stamp
    kept = (dest / "runs" / "spo" / "default_seed0" / "spo" / "train" / "metrics.jsonl").read_text()
    assert "loss/online" not in kept and kept.count("\n") == 10
    there = study.model_copy(update={"out_dir": str(dest)})
    assert write_report(there, dest, chosen).read_text() == want

    def must_not_run(*a, **k):
        raise AssertionError("a finished run was run again")
    monkeypatch.setattr(st.subprocess, "run", must_not_run)
    assert st.run_one(there, st.RunSpec("runs", "ppo", 1, ()), dest, print)["pass@1"] == {"after": 0.3}
    with pytest.raises(FileNotFoundError, match=r"compare --archive: .* is not a study's out_dir \(no study.json\)"):
        archive(tmp_path / "nowhere", dest)
    with pytest.raises(ValueError, match="is the study's own out_dir"):
        archive(root, root)
    with pytest.raises(FileExistsError, match=r"compare --archive: .*archive is not empty \(remove it"):
        archive(root, dest)  # a second archive into the first would mix their files


def _bootstrap_by_hand(diff, resamples=4000, seed=0):
    """two_way_bootstrap as it was written first (random.Random draws, a sum per resample): the numbers of every
    committed report."""
    rng = random.Random(seed)
    n_s, n_p = len(diff), len(diff[0])
    means = []
    for _ in range(resamples):
        seeds = [rng.randrange(n_s) for _ in range(n_s)]
        problems = [rng.randrange(n_p) for _ in range(n_p)]
        total = 0.0
        for s in seeds:
            for p in problems:
                total += diff[s][p]
        means.append(total / (n_s * n_p))
    means.sort()
    return sum(map(sum, diff)) / (n_s * n_p), means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]


def test_the_bootstrap_draws_what_random_draws_and_sums_in_its_order(monkeypatch):
    """The vectorised bootstrap gives the loop's intervals bit for bit (the same Mersenne Twister words, the same
    rejections, the same order of additions), also when its first batch of random words runs out."""
    from megatron_spo.experiments import study_report

    rng = random.Random(7)
    for n_s, n_p, resamples, seed in [(1, 1, 50, 0), (1, 7, 300, 3), (2, 2, 500, 1), (3, 120, 300, 0), (4, 33, 200, 9)]:
        diff = [[rng.choice([-1.0, -0.95, 0.0, 0.05, 1 / 3, 1.0]) for _ in range(n_p)] for _ in range(n_s)]
        assert two_way_bootstrap(diff, resamples=resamples, seed=seed) == _bootstrap_by_hand(diff, resamples, seed)
    monkeypatch.setattr(study_report, "_WORDS_MARGIN", 0.05)  # too few words at first: more are drawn
    study_report._draws.cache_clear()
    diff = [[rng.random() for _ in range(40)] for _ in range(3)]
    assert two_way_bootstrap(diff, resamples=400, seed=2) == _bootstrap_by_hand(diff, 400, 2)
    study_report._draws.cache_clear()


REPO = Path(__file__).resolve().parents[1]
CODE_FULL = REPO / "docs" / "study-2026-11-26" / "code-full"


def _table(text: str, header_start: str) -> list[list[str]]:
    """The rows (cells stripped) of the markdown table whose header starts with header_start."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(header_start))
    rows = []
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        rows.append([c.strip() for c in ln.strip().strip("|").split("|")])
    return rows


def test_an_archived_study_rewrites_its_report_from_its_own_settings(tmp_path, capsys):
    """`compare --report-only out_dir=ARCHIVE` with no other override reads the study's settings from the archive's
    study.json: the committed report comes back byte for byte, and with it the README's code table."""
    import shutil

    out = tmp_path / "code-full"
    shutil.copytree(CODE_FULL, out)
    for made in ("report.md", "report.json"):
        (out / made).unlink()
    assert st.main(["--report-only", f"out_dir={out}"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"report: {out / 'report.md'}")
    report = (out / "report.md").read_text()
    assert report == (CODE_FULL / "report.md").read_text()
    assert (out / "report.json").read_text() == (CODE_FULL / "report.json").read_text()

    held = {r[0]: r for r in _table(report, "| arm | seeds x problems | pass@1 | change |")}
    minus = {r[0]: r for r in _table(report, "| arm | pass@1 | pass@10 | pass@10 - pass@1 | distinct correct |")}
    long = {r[0]: r for r in _table(report, "| arm | seeds x problems | pass@1 1x -> long |")}

    def two_places(cell: str) -> str:  # the README gives distinct correct programs to 2 decimals
        return " ".join(f"{float(x.strip('[],')):+.2f}" for x in cell.split()).replace(" ", ", ").replace(
            ", ", " [", 1) + "]"

    readme = (REPO / "README.md").read_text()
    rows = _table(readme, "| arm (chosen lr, coefficient) | pass@1 / pass@10 | SPO minus arm: pass@1 | pass@10 | "
                          "pass@10 - pass@1 | distinct correct")
    arms = {"reference": "reference", "SPO, online + offline": "spo", "SPO online only": "spo-online",
            "SPO at the paper's settings": "spo-paper", "AGRO": "agro", "PPO": "ppo", "GRPO, push": "grpo",
            "GRPO + TIS": "grpo-tis"}
    assert len(rows) == len(arms)
    for row in rows:
        arm = next(a for prefix, a in arms.items() if row[0].startswith(prefix))
        assert row[1] == f"{held[arm][2]} / {held[arm][4]}", row
        if arm in ("reference", "spo"):
            assert row[2:6] == ["", "", "", ""], row
        else:
            assert row[2:5] == minus[arm][1:4] and row[5] == two_places(minus[arm][4]), row
        if arm != "reference":
            assert row[6] == f"{long[arm][3]} / {long[arm][5]}", row


OFFPOLICY = REPO / "docs" / "study-2026-11-28-offpolicy"
OFFPOLICY_ARCHIVES = sorted(p.parent.name for p in OFFPOLICY.glob("*/study.json"))


@pytest.mark.parametrize("name", OFFPOLICY_ARCHIVES)
def test_each_offpolicy_archive_rewrites_its_report_byte_for_byte(tmp_path, capsys, name):
    """Issue 48's archives (one per task and kind of data): `compare --report-only` gives each report back."""
    import shutil

    out = tmp_path / name
    shutil.copytree(OFFPOLICY / name, out)
    for made in ("report.md", "report.json"):
        (out / made).unlink()
    assert st.main(["--report-only", f"out_dir={out}"]) == 0
    capsys.readouterr()
    assert (out / "report.md").read_text() == (OFFPOLICY / name / "report.md").read_text()


def test_the_readme_recommendation_table_is_the_archives_against_grpo_tables():
    """The README's table of what to run with each kind of data: one row per archive (its link names it), each cell
    the archive report's "each arm against GRPO without it" cell (minus grpo, pass@1 / pass@10, with intervals), and
    the data arms' seeds (one number, or the range where an archive holds fewer of some arm); "not run" for an arm
    the archive does not hold."""
    rows = _table((REPO / "README.md").read_text(), "| task | the data |")
    arms = ["spo-data", "grpo-guided", "sft-grpo", "sft-spo"]
    linked = []
    for row in rows:
        name = row[1].split("](docs/study-2026-11-28-offpolicy/")[1].split("/report.md)")[0]
        linked.append(name)
        report = (OFFPOLICY / name / "report.md").read_text()
        against = {r[0]: r for r in _table(report, "| arm | seeds | pass@1 / pass@10 | minus grpo: pass@1 |")}
        ran = [a for a in arms if a in against]
        assert row[2] == "-".join(sorted({against[a][1] for a in ran})), (name, row)  # seeds of the data arms
        assert row[3] == against["grpo"][2], (name, row)
        assert row[4:] == [f"{against[a][3]} / {against[a][4]}" if a in against else "not run" for a in arms], \
            (name, row)
    assert sorted(linked) == OFFPOLICY_ARCHIVES  # every archive has its row



def test_the_readme_what_to_run_table_quotes_the_archives():
    """Every difference the README's "what to run" table quotes (x.xxx, with its interval where it gives one) is
    printed as such in one of the issue-48 archives' reports (a bare one as a value, not an interval's end): the
    advice cannot drift from the runs."""
    import re

    rows = _table((REPO / "README.md").read_text(), "| your data | run | do not |")
    reports = "\n".join((OFFPOLICY / name / "report.md").read_text() for name in OFFPOLICY_ARCHIVES)
    quoted = [m.group(0) for row in rows for cell in row
              for m in re.finditer(r"[-+]\d\.\d{3}(?: \[[-+]\d\.\d{3}, [-+]\d\.\d{3}\])?", cell)]
    assert len(rows) == 3 and len(quoted) >= 15
    # a bare difference must be one the reports print as a value, not an interval's end
    assert [q for q in quoted if not re.search(r"(?<!\[)(?<!, )" + re.escape(q) + r"(?![\d\]])", reports)] == []

def test_an_archived_study_refuses_other_settings_in_one_line(tmp_path, capsys):
    """Overrides that change the archive's settings are one line naming each field with both values, not a
    report of failed runs; repeating the archive's own values is fine; a folder without study.json is refused."""
    import shutil

    from megatron_spo.cli import main as cli

    out = tmp_path / "code-full"
    shutil.copytree(CODE_FULL / "shared", out / "shared")
    shutil.copytree(CODE_FULL / "runs" / "spo", out / "runs" / "spo")  # train_steps 90: the steps it ran at
    shutil.copy(CODE_FULL / "study.json", out / "study.json")
    assert json.loads((out / "study.json").read_text())["quickstart"] == {}
    study = st.load_study([f"out_dir={out}"], report_only=True)
    assert study.out_dir == str(out) and study.seeds == [0, 1, 2] and not study.sweep.enabled
    assert study.quickstart == {"train": {"steps": 90}} and study.settings["spo"] == {"train.lr": 1e-4,
                                                                                      "train.beta": 0.5}
    same = st.load_study([f"out_dir={out}", "sweep.enabled=false", "seeds=[0,1,2]", "quickstart.train.steps=90",
                          "long_run.seeds=[0,1]", "progress=false"], report_only=True)
    assert same.seeds == [0, 1, 2] and same.progress is False

    assert cli(["compare", "--report-only", f"out_dir={out}", "seeds=[0,1]", "quickstart.train.steps=60",
                "settings.spo.train.lr=0.0003"]) == 2
    err = capsys.readouterr().err
    assert err == (f"megatron-spo compare: config error: compare --report-only: the overrides change "
                   f"{out / 'study.json'}: seeds [0, 1] given, [0, 1, 2] in the study; quickstart.train.steps 60 "
                   f"given, 90 in the study; settings.spo.train.lr 0.0003 given, 0.0001 in the study (the runs "
                   f"were made with the study's settings: drop the overrides)\n")
    assert not (out / "report.md").exists()

    said = []  # resuming runs the changed study, and says what changed
    resumed = st.load_study([f"out_dir={out}", "seeds=[0,1,2,3]"], log=said.append)
    assert resumed.seeds == [0, 1, 2, 3] and resumed.settings == study.settings
    assert said == [f"compare: resuming {out} with changed settings: seeds [0, 1, 2, 3] given, [0, 1, 2] in the "
                    f"study"]
    assert cli(["compare", "--report-only", f"out_dir={tmp_path / 'nothing'}"]) == 2
    assert capsys.readouterr().err == (f"megatron-spo compare: config error: compare --report-only: "
                                       f"{tmp_path / 'nothing'} holds no study (no study.json): name a study's "
                                       f"out_dir or an archive of one\n")


def test_the_report_shows_which_tokens_carry_the_studys_data_per_source(tmp_path):
    """Issue 48: for arms trained on the study's data (SPO's source 'data', GRPO's 'guide'), per source, the last
    10 steps' means of the sequence log-ratio, log-ratio and Q_t by quarter and the residual, then over seeds; the
    archive keeps those metrics, so --report-only rewrites the section."""
    from megatron_spo.experiments.study_report import archive

    root = tmp_path / "study"
    study = build_config(st.StudyConfig, {"out_dir": str(root), "arms": ["spo-data", "grpo-guided", "grpo"],
                                          "data": ["/d"], "seeds": [0, 1], "sweep": {"enabled": False},
                                          "long_run": {"seeds": []}})
    root.mkdir()
    for seed in (0, 1):
        _fake_reference(root, seed)
        for arm in study.arms:
            _fake_run(root, study, arm, seed, 0.4, 0.9, pushes=1, wall=90)
        extra = []
        for step in range(1, 13):  # steps 1-2 fall outside the last 10
            late = step > 2
            spo = {f"{k}/{src}": (v + seed if late else 99.0) for src, base in (("data", 1.0), ("online", 0.0))
                   for k, v in [("mean_seq_log_ratio", base), ("residual_mean", -0.5 + base)]
                   + [(f"log_ratio_pos{q}", base + q / 10) for q in range(1, 5)]
                   + [(f"q_pos{q}", base - q / 10) for q in range(1, 5)]}
            extra.append(("spo-data", {"step": 100 + step, **spo}))
            extra.append(("grpo-guided", {"step": 100 + step, "mean_seq_log_ratio/guide": 2.0 if late else 99.0,
                                          "mean_seq_log_ratio/online": 0.5, "guide_share": 0.2}))
        for arm, m in extra:
            with (st.RunSpec("runs", arm, seed, ()).run_dir(root) / "train" / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(m) + "\n")
    (root / "study.json").write_text(study.model_dump_json())
    chosen = {a: {"settings": {}} for a in study.arms}
    report = write_report(study, root, chosen).read_text()
    assert "## Which tokens carry it: the study's data against the policy's own samples" in report
    # seeds 0 and 1 add 0 and 1: means +0.5 over them
    assert "| spo-data | data | +1.500 | +1.600 / +1.700 / +1.800 / +1.900 | +1.400 / +1.300 / +1.200 / +1.100 | " \
           "+1.000 |" in report
    assert "| spo-data | online | +0.500 | +0.600 / +0.700 / +0.800 / +0.900 | +0.400 / +0.300 / +0.200 / +0.100 " \
           "| +0.000 |" in report
    assert "| grpo-guided | guide | +2.000 | - / - / - / - | - / - / - / - | - |" in report
    assert "| grpo |" not in report.split("## Which tokens carry it")[1].split("##")[0]  # no data: no row
    archive(root, tmp_path / "archive")
    there = study.model_copy(update={"out_dir": str(tmp_path / "archive")})
    assert write_report(there, tmp_path / "archive", chosen).read_text() == report


def test_the_report_gives_what_sft_alone_gave_and_what_rl_added(tmp_path):
    """Issue 48: per arm with an SFT stage, the SFT'd policy's own held-out evaluation (eval_sft.jsonl) against
    the reference and against the run after RL, paired, with the step early stopping kept; the archive keeps it."""
    from megatron_spo.experiments.study_report import archive

    root = tmp_path / "study"
    study = build_config(st.StudyConfig, {"out_dir": str(root), "arms": ["sft-grpo", "grpo"], "data": ["/d"], "validation_held_out": True,
                                          "seeds": [0, 1], "sweep": {"enabled": False}, "long_run": {"seeds": []}})
    root.mkdir()
    for seed in (0, 1):
        _fake_reference(root, seed)
        for arm in study.arms:
            _fake_run(root, study, arm, seed, 0.4, 0.9, pushes=1, wall=90)
        run = st.RunSpec("runs", "sft-grpo", seed, ()).run_dir(root)
        sft = [{"prompt_id": p, "n": 20, "correct": 0, "pass@1": 0.3, "pass@10": 0.7, "tests": {}} for p in PROBLEMS]
        (run / "eval_sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
        results = json.loads((run / "results.json").read_text())
        results["sft"] = {"chosen_step": 10 + 5 * seed, "settings": {"steps": 60}}
        (run / "results.json").write_text(json.dumps(results))
    (root / "study.json").write_text(study.model_dump_json())
    chosen = {a: {"settings": {}} for a in study.arms}
    report = write_report(study, root, chosen).read_text()
    section = report.split("## The SFT stage: what SFT alone gave, and what RL added")[1].split("##")[0]
    assert (f"| sft-grpo | 2 x {len(PROBLEMS)} | 10 of 60, 15 of 60 | 0.300 | +0.100 [+0.100, +0.100] | "
            "+0.100 [+0.100, +0.100] | 0.700 | +0.100 [+0.100, +0.100] | +0.200 [+0.200, +0.200] |") in section
    assert "| grpo |" not in section  # no SFT stage: no row
    archive(root, tmp_path / "archive")
    there = study.model_copy(update={"out_dir": str(tmp_path / "archive")})
    assert write_report(there, tmp_path / "archive", chosen).read_text() == report


def test_the_report_sets_a_multi_turn_arms_last_turn_against_single_turn_spo(tmp_path):
    """An arm whose runs evaluated the held-out problems as conversations (eval_turns_after.json): its first and
    last turns' pass@k, last minus first, and each against single-turn SPO's samples, paired per seed and problem."""
    from megatron_spo.experiments.study_report import ArmRuns, _multi_turn, paired_difference

    def rec(pid, p1, p10):
        return {"prompt_id": pid, "n": 10, "correct": round(10 * p1), "pass@1": p1, "pass@10": p10, "tests": {}}

    rng = random.Random(4)
    single_runs, multi_runs, last, single = {}, {}, {}, {}
    for seed in (0, 1):
        (tmp_path / "shared" / f"seed{seed}").mkdir(parents=True)
        (tmp_path / "shared" / f"seed{seed}" / "eval_before.jsonl").write_text(
            "".join(json.dumps(rec(f"q{i}", 0.1, 0.5)) + "\n" for i in range(4)))
        for name, runs in (("spo", single_runs), ("spo-multi-turn", multi_runs)):
            run = tmp_path / name / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "results.json").write_text("{}")
            values = [(round(rng.random(), 1), 1.0) for _ in range(4)]
            (run / "eval_after.jsonl").write_text("".join(json.dumps(rec(f"q{i}", *v)) + "\n"
                                                          for i, v in enumerate(values)))
            runs[seed] = run
            single[name, seed] = [v[0] for v in values]
        lasts = [round(rng.random(), 1) for _ in range(4)]
        last[seed] = lasts
        (multi_runs[seed] / "eval_turns_after.json").write_text(json.dumps({
            "first_turn": {"problems": [rec(f"q{i}", single["spo-multi-turn", seed][i], 1.0) for i in range(4)]},
            "last_turn": {"problems": [rec(f"q{i}", v, 1.0) for i, v in enumerate(lasts)]},
            "mean_turns": 1.5 + seed, "fixed_share": 0.25}))
    spo, multi = ArmRuns("spo", single_runs, tmp_path), ArmRuns("spo-multi-turn", multi_runs, tmp_path)
    lines = _multi_turn([spo, multi], spo)
    [row] = [x for x in lines if x.startswith("| spo-multi-turn")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    first = sum(sum(single["spo-multi-turn", s]) for s in (0, 1)) / 8  # summed as the report sums: seed by seed
    mean_last = sum(sum(last[s]) for s in (0, 1)) / 8
    assert cells[:2] == ["spo-multi-turn", "2 x 4"] and cells[2] == f"{first:.3f} / 1.000"
    assert cells[3] == f"{mean_last:.3f} / 1.000" and cells[5:7] == ["2.00", "25.0%"]
    want = paired_difference([last[s] for s in (0, 1)], [single["spo", s] for s in (0, 1)])
    assert cells[7] == f"{want[0]:+.3f} [{want[1]:+.3f}, {want[2]:+.3f}]"
    assert not [x for x in lines if x.startswith("| spo |")]  # a single-turn arm has no row
    assert _multi_turn([spo], spo) == []


STUDIES_12_02 = sorted(str(p.parent.relative_to(REPO / "docs")) for p in (REPO / "docs").glob("study-2026-12-02-*/*/study.json"))


@pytest.mark.parametrize("name", STUDIES_12_02)
def test_each_2026_12_02_archive_rewrites_its_report_byte_for_byte(tmp_path, capsys, name):
    """Issue 62's Q0-prior study and issue 63's multi-turn study: `compare --report-only` gives each report back."""
    import shutil

    out = tmp_path / "study"
    shutil.copytree(REPO / "docs" / name, out)
    for made in ("report.md", "report.json"):
        (out / made).unlink()
    assert st.main(["--report-only", f"out_dir={out}"]) == 0
    capsys.readouterr()
    assert (out / "report.md").read_text() == (REPO / "docs" / name / "report.md").read_text()
