"""End-to-end: the quickstart at reduced size with 2 trainer ranks (TP=2) on gloo, 2 local engines behind
the real sglang-router, the real sandbox, weight pushes, offline + online data, evaluation before/after."""

import json
import os
import subprocess
import sys

import psutil
import pytest

from megatron_spo.training.metrics import PANELS, UNPLOTTED, panel_names

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def _bwrap_usable() -> bool:
    return os.geteuid() == 0 and subprocess.run(["which", "bwrap"], capture_output=True).returncode == 0


def _fleet_processes(tag: str) -> list:
    """Engines and routers started under this test's quickstart: they inherit its MEGATRON_SPO_TEST_RUN, so
    another quickstart on the machine (a study, a second CI job) is not counted."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "megatron_spo.cli router" in cmd or "megatron_spo.cli serve" in cmd or "engine_server" in cmd:
            try:
                if p.environ().get("MEGATRON_SPO_TEST_RUN") == tag:
                    out.append(cmd)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
    return out


@pytest.mark.skipif(not _bwrap_usable(), reason="the sandbox needs root and bubblewrap (tools/bootstrap.sh)")
def test_quickstart_end_to_end_small(tmp_path):
    tag = str(tmp_path)
    out = tmp_path / "qs"
    args = [f"out_dir={out}", f"cache_dir={tmp_path / 'cache'}", "reference.sft_steps=8", "reference.batch_size=8", "reference.task.num_problems=24",
            "q0_samples=4", "offline_per_prompt=2", "eval_n=10", "heldout_limit=4", "train_limit=6", "train_eval_limit=40",
            "train.steps=4", "train.model_update_interval=2", "train.prompts_per_step=2", "train.samples_per_prompt=4",
            "train.nproc=2", "train.tensor_model_parallel_size=2", "train.max_new_tokens=48", "progress=false"]
    # 8 SFT steps of 8 sequences (was 40 of 32: 110 s of the test's 375 s beside a study): pass@1 is 0 either way
    # and the offline set is the task's own solutions, so the reference's quality is not what this test checks
    proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "quickstart", *args], capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "MEGATRON_SPO_TEST_RUN": tag})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run = out / "spo"

    result = json.loads((run / "results.json").read_text())
    assert (result["problems"], result["samples_per_problem"]) == (4, 10)
    for k in ("pass@1", "pass@10"):
        r = result[k]
        assert 0 <= r["before"] <= 1 and 0 <= r["after"] <= 1
        assert r["ci95"][0] <= r["delta"] <= r["ci95"][1]
        assert r["delta"] == pytest.approx(r["after"] - r["before"], abs=1e-9)
    assert result["train_steps"] == 4 and result["weight_pushes"] == 2  # steps 2 and 4
    from megatron_spo.experiments.reference_model import reference_identity

    (ref,) = (tmp_path / "cache").glob("quickstart-ref-*")  # the run names the weights it started from
    assert result["reference"] == reference_identity(ref) == json.loads((run / "reference.json").read_text())
    train = result["training_prompts"]  # the same table on training prompts (train_eval_limit=40: all 6)
    assert (train["problems"], train["samples_per_problem"]) == (6, 10)
    assert train["pass@1"]["delta"] == pytest.approx(train["pass@1"]["after"] - train["pass@1"]["before"], abs=1e-9)

    metrics = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all("loss/online" in m for m in metrics)  # rollouts from the engines every step
    assert any("loss/offline" in m for m in metrics)  # and the offline set of correct reference samples
    assert all(m["rollout/groups"] >= 1 for m in metrics)
    assert [m["policy_version"] for m in metrics] == [0, 1, 1, 2]
    # online data lags the trainer by at most rollout.max_staleness (2 x model_update_interval = 4) versions
    assert metrics[0]["staleness/max"] == 0 and all(0 <= m["staleness/max"] <= 4 for m in metrics)
    assert all(-1.0 <= m["reward/online"] <= 0.0 for m in metrics)
    assert all("weight_sync/bytes_per_s" in metrics[i] for i in (1, 3))
    # the KL estimate is on the online samples only (the offline set is the reference's own samples)
    assert all(m["kl"] == m["mean_seq_log_ratio/online"] for m in metrics)
    logged = {k for m in metrics for k in m} - UNPLOTTED  # every metric the run logs has a plot panel
    assert logged - {n for title in PANELS for n in panel_names(title, logged)} == set()

    offline = [json.loads(line) for line in (run / "offline.jsonl").read_text().splitlines()]
    assert len(offline) >= 6 and all(r["reward"] == 0.0 for r in offline)  # correct samples + task solutions
    q0 = [json.loads(line) for line in (run / "q0.jsonl").read_text().splitlines()]
    assert len(q0) == 6 and all(r["n"] == 4 and -1.0 <= r["q0"] <= 0.0 for r in q0)

    assert (run / "train" / "hf" / "config.json").exists()  # the final policy, as an HF directory
    assert (run / "train" / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    assert (run / "plots" / "pass_at_k.png").exists() and (run / "plots" / "loss.png").exists()
    assert "pass@1" in proc.stdout and "95% CI" in proc.stdout
    assert _fleet_processes(tag) == [], "engines or the router outlived the quickstart"


@pytest.mark.skipif(not _bwrap_usable(), reason="the sandbox needs root and bubblewrap (tools/bootstrap.sh)")
def test_quickstart_multi_turn_code_feedback(tmp_path):
    """`megatron-spo quickstart env=code_feedback`, small: the online rollouts are conversations with the sandbox's
    feedback between the model's programs, weights pushed every step (mid-conversation for some), and the trainer
    trains on them; the archive keeps their mask and turn versions."""
    from megatron_spo.data.experience import iter_trajectories
    from megatron_spo.data.trajectory import model_turns

    tag = str(tmp_path)
    out = tmp_path / "qs"
    args = [f"out_dir={out}", f"cache_dir={tmp_path / 'cache'}", "env.name=code_feedback", "env.max_turns=3",
            "env.feedback_chars=40", "reference.sft_steps=8", "reference.batch_size=8",
            "reference.task.num_problems=24", "engines=1", "q0_samples=4", "offline_per_prompt=1", "eval_n=10",
            "heldout_limit=2", "train_limit=4", "train.steps=3", "train.model_update_interval=1",
            "train.prompts_per_step=2", "train.samples_per_prompt=2", "train.max_new_tokens=40", "progress=false"]
    proc = subprocess.run([sys.executable, "-m", "megatron_spo.cli", "quickstart", *args], capture_output=True,
                          text=True, timeout=1500, env={**os.environ, "MEGATRON_SPO_TEST_RUN": tag})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run = out / "spo"
    result = json.loads((run / "results.json").read_text())
    assert result["train_steps"] == 3
    # the held-out problems as conversations too: each turn's pass@k, the last against single-turn sampling
    turns = {tag: json.loads((run / f"eval_turns_{tag}.json").read_text()) for tag in ("before", "after")}
    multi = result["multi_turn"]
    assert multi["env"] == "code_feedback" and multi["max_turns"] == 3
    for tag, t in turns.items():
        assert t["first_turn"]["num_problems"] == t["last_turn"]["num_problems"] == 2 and 1 <= t["mean_turns"] <= 3
        assert multi[tag]["last_vs_first"]["pass@1"]["after"] == pytest.approx(t["last_turn"]["mean"]["pass@1"])
        assert multi[tag]["last_vs_first"]["pass@1"]["before"] == pytest.approx(t["first_turn"]["mean"]["pass@1"])
    assert multi["last_turn_vs_single_turn"]["pass@1"]["before"] == pytest.approx(result["pass@1"]["after"])
    line = "multi-turn (code_feedback, up to 3 turns), held-out pass@1 after training: last turn"
    assert line in " ".join(proc.stdout.split())  # (the console wraps it)
    metrics = [json.loads(line) for line in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3] and all("loss/online" in m for m in metrics)
    assert all(m["rollout/conversations"] >= 1 and m["rollout/env_errors"] == 0 for m in metrics)
    assert max(m["rollout/turns_per_conversation"] for m in metrics) > 1  # the feedback was answered
    records = [r for r in iter_trajectories([run / "train" / "experience"]) if r.source == "online"]
    assert records and all(r.response_mask is not None and len(r.turn_versions) == len(model_turns(r.response_mask))
                           for r in records)
    assert any(0 in r.response_mask for r in records)  # environment tokens, kept as context
    assert all(len(r.prompt_tokens) + len(r.response_tokens) <= 256 for r in records)  # env.max_total_tokens
    assert _fleet_processes(tag) == [], "engines or the router outlived the quickstart"
