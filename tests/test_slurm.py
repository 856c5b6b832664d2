"""The project's sbatch script on a real SLURM cluster (munged + slurmctld + 4 slurmds on this host).

slurm/probe.py stands in for the trainer, the engines and the Q0 driver (tests/test_slurm_trainer.py runs the
real ones); the router is the real sglang-router. What is proven: the heterogeneous layout
and its env contract (ranks, MASTER_ADDR/PORT through a real gloo rendezvous, router and engine URLs),
the Q0 stage ordered before training by afterok, per-component logs, preemption (SIGUSR1 -> checkpoint ->
requeue -> resume continuing the step counter) and fail-fast when a component dies.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import slurm_helpers
from slurm_helpers import REPO, SUBMIT, batch_log, job_info, wait_job

cluster = slurm_helpers.cluster  # the module-scoped fixture: a fresh 4-node cluster for this module


def submit(cluster, run_dir: Path, *args: str, **env_extra: str) -> dict[str, str]:
    env = dict(cluster["env"], **env_extra)
    out = subprocess.run(["bash", str(SUBMIT), "--mode", "cpu", "--probe", "--run-dir", str(run_dir),
                          "--time", "30:00", *args], env=env, check=True, capture_output=True, text=True, timeout=60)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def read_env(run_dir: Path, name: str) -> dict:
    return json.loads((run_dir / "probe" / f"env-{name}.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "probe" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_submit_rejects_bad_arguments():
    out = subprocess.run(["bash", str(SUBMIT), "--mode", "tpu"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == "submit.sh: --mode must be gpu or cpu, got 'tpu'"
    out = subprocess.run(["bash", str(SUBMIT), "--trainer-nodes", "0"], capture_output=True, text=True)
    assert out.stderr.strip() == "submit.sh: --trainer-nodes must be a positive integer, got '0'"


def test_job_script_refuses_bad_parameters_before_launching(tmp_path):
    """Checks that run in the batch shell before any srun (no cluster needed)."""
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SLURM_JOB_ID": "7", "SPO_HOME": str(REPO),
            "RUN_DIR": str(tmp_path / "run")}
    script = str(REPO / "slurm" / "spo.sbatch")
    cases = [
        ({}, "this script needs a heterogeneous job (trainer : workers); submit it with slurm/submit.sh"),
        ({"SLURM_HET_SIZE": "2", "CONFIG": "/no/such.yaml"},
         "CONFIG='/no/such.yaml' is not a file (TRAIN_CMD uses it; pass --config to slurm/submit.sh)"),
        ({"SLURM_HET_SIZE": "2", "TRAIN_CMD": "true", "MODE": "tpu"}, "MODE must be gpu or cpu, got 'tpu'"),
        ({"SLURM_HET_SIZE": "2", "TRAIN_CMD": "true", "ENGINE_TP": "3"},
         "ENGINE_TP=3 does not divide GPUS_PER_NODE=8"),
    ]
    for extra, message in cases:
        out = subprocess.run(["bash", script], env={**base, **extra}, capture_output=True, text=True, timeout=30)
        assert out.returncode == 1
        assert out.stderr.strip().endswith(f"ERROR: {message}"), out.stderr


def test_hetjob_layout_q0_then_train(cluster):
    """Test A: Q0 stage, then (afterok) 2 trainer nodes x 2 ranks + 2 worker nodes x 2 engines + router."""
    run_dir = cluster["root"] / "run_a"
    jobs = submit(cluster, run_dir, "--q0", "--trainer-nodes", "2", "--procs-per-node", "2", "--worker-nodes", "2",
                  "--engines-per-node", "2", PROBE_TRAIN_ARGS="--steps 6 --step-seconds 0.2 --save-every 3")
    train = wait_job(cluster, jobs["train"], 120)
    q0 = job_info(cluster, jobs["q0"])
    assert [c["JobState"] for c in q0] == ["COMPLETED", "COMPLETED"], batch_log(run_dir)
    assert [c["JobState"] for c in train] == ["COMPLETED", "COMPLETED"], batch_log(run_dir)
    assert train[0]["Dependency"] in ("(null)", f"afterok:{jobs['q0']}(unfulfilled)")  # satisfied and cleared
    assert train[0]["Restarts"] == "0"

    # Trainer component: RANK/LOCAL_RANK/NODE_RANK from SLURM, one MASTER_ADDR:PORT, a real rendezvous.
    ranks = [read_env(run_dir, f"trainer-rank{r}-restart0") for r in range(4)]
    trainer_nodes = subprocess.run(["scontrol", "show", "hostnames", train[0]["NodeList"]], env=cluster["env"],
                                   capture_output=True, text=True, check=True).stdout.split()
    worker_nodes = subprocess.run(["scontrol", "show", "hostnames", train[1]["NodeList"]], env=cluster["env"],
                                  capture_output=True, text=True, check=True).stdout.split()
    assert len(trainer_nodes) == 2 and len(worker_nodes) == 2 and not set(trainer_nodes) & set(worker_nodes)
    for r, rec in enumerate(ranks):
        env = rec["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["NODE_RANK"]) == (str(r), "4", str(r % 2), str(r // 2))
        assert env["SLURMD_NODENAME"] == trainer_nodes[r // 2]
        assert env["MASTER_ADDR"] == "127.0.0.1"  # n1's NodeAddr on this cluster (the hostname on most)
        assert env["MASTER_PORT"] == ranks[0]["env"]["MASTER_PORT"]
        assert rec["rank_sum"] == 0 + 1 + 2 + 3  # gloo all_reduce across both nodes succeeded
        assert rec["q0_present"] is True  # the Q0 job finished before any trainer rank started
        assert env["SPO_RESTART_COUNT"] == "0" and rec["start_step"] == 0

    # Worker component: one engine per URL, on the worker nodes; the router in front of them.
    urls = ranks[0]["env"]["SPO_ENGINE_URLS"].split(",")
    assert len(urls) == 4 and len(set(urls)) == 4
    engine_names = {f"{p.name[len('env-engine-'):-len('.json')]}" for p in (run_dir / "probe").glob("env-engine-*.json")}
    train_engines = {f"{worker_nodes[i // 2]}-{u.rsplit(':', 1)[1]}" for i, u in enumerate(urls)}
    assert train_engines <= engine_names
    served = ranks[0]["generate_via_router"]
    assert served.startswith("probe-engine@") and served.split("@")[1].replace(":", "-") in train_engines
    q0_rows = [json.loads(x) for x in (run_dir / "q0" / "q0.jsonl").read_text().splitlines()]
    assert q0_rows[0]["served_by"].startswith("probe-engine@")

    # Metrics, checkpoints and per-component / per-rank logs.
    assert [m["step"] for m in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-6"
    assert (run_dir / "checkpoints" / "step-3" / "state.json").is_file()
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {f"trainer-rank{r}.log" for r in range(4)} | {"workers-node0.log", "workers-node1.log", "router.log",
                                                         "q0.log"} <= logs
    assert "trainer finished" in batch_log(run_dir)


def test_preemption_checkpoints_requeues_and_resumes(cluster):
    """Test B: SIGUSR1 to the batch shell (what --signal=B:USR1@N sends) mid-run."""
    run_dir = cluster["root"] / "run_b"
    jobs = submit(cluster, run_dir, "--trainer-nodes", "2", "--procs-per-node", "1", "--worker-nodes", "1",
                  PROBE_TRAIN_ARGS="--steps 30 --step-seconds 0.25 --save-every 100")
    job = jobs["train"]
    wait_job(cluster, job, 90, until=lambda: len(metrics(run_dir)) >= 3)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster["env"], check=True)
    info = wait_job(cluster, job, 120)
    log = batch_log(run_dir)
    assert [c["JobState"] for c in info] == ["COMPLETED", "COMPLETED"], log
    assert info[0]["Restarts"] == "1", log
    assert "SIGUSR1 (time limit or preemption)" in log and f"requeueing job {job}" in log

    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == list(range(1, 31))  # continues, never restarts or repeats
    stopped_at = max(m["step"] for m in rows if m["restart"] == 0)
    assert 3 <= stopped_at < 30 and all(m["restart"] == 1 for m in rows if m["step"] > stopped_at)
    assert (run_dir / "checkpoints" / f"step-{stopped_at}" / "state.json").is_file()  # the signal's checkpoint
    for r in range(2):
        resumed = read_env(run_dir, f"trainer-rank{r}-restart1")
        assert resumed["env"]["SPO_RESTART_COUNT"] == "1"
        assert resumed["start_step"] == stopped_at
        assert resumed["resumed_from"].endswith(f"step-{stopped_at}")
    assert f"resuming from step-{stopped_at}" in log
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-30"


def test_dead_worker_fails_the_job_fast(cluster):
    """An engine that exits stops the trainer and fails the job, naming the component and its logs."""
    run_dir = cluster["root"] / "run_c"
    jobs = submit(cluster, run_dir, "--trainer-nodes", "1", "--worker-nodes", "1",
                  ENGINE_CMD="bash -c 'echo engine crashed; exit 3'", PROBE_TRAIN_ARGS="--steps 1000")
    start = time.monotonic()
    info = wait_job(cluster, jobs["train"], 60)
    assert time.monotonic() - start < 45
    assert info[0]["JobState"] == "FAILED"
    log = batch_log(run_dir)
    assert "ERROR: worker component died (exit 3) while the trainer was running" in log
    workers_log = (run_dir / "logs" / "workers-node0.log").read_text()
    assert "ERROR: engine 0 (http://127.0.0.1:" in workers_log and "exited with status 3" in workers_log
    assert metrics(run_dir) == []
