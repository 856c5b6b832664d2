"""The project's sbatch script on a real SLURM cluster (munged + slurmctld + 4 slurmds on this host).

slurm/probe.py stands in for the trainer, the engines and the Q0 driver (tests/test_slurm_trainer.py runs the
real ones); the router is the real sglang-router. What is proven: the heterogeneous layout
and its env contract (ranks, MASTER_ADDR/PORT through a real gloo rendezvous, router and engine URLs),
the Q0 stage ordered before training by afterok, per-component logs, preemption (SIGUSR1 -> checkpoint ->
requeue -> resume continuing the step counter) and fail-fast when a component dies. Without a cluster: the engine
command spo.sbatch builds for a mixture-of-experts run (the routed-experts flags) and a dense one (none).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import slurm_helpers
from slurm_helpers import REPO, SUBMIT, batch_log, job_commands, job_info, wait_job

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


@pytest.mark.slow
def test_the_engines_of_a_moe_run_return_routes_and_a_dense_runs_get_no_flag(tmp_path):
    """routing_replay: engine (the default) on a mixture-of-experts model asks every rollout for its routes, so the
    train stage starts its engines with --enable-return-routed-experts: megatron-spo serve's (MODE=cpu); SGLang's
    (MODE=gpu) with --ep-size ENGINE_TP where the 6 experts split evenly (TP 2; not TP 4), as SGLang's own
    server_args parse them. A dense model, routing_replay off and the Q0 stage: no flag. The MODE=cpu engine, started
    as launch_workers.sh starts it, returns each sample's routes (layers x top-2 per routed position)."""
    import moe_helpers
    import rollout_helpers
    import sglang_source as sgl

    from megatron_spo.data.routes import RoutedExperts
    from megatron_spo.rollout.client import post_json
    from megatron_spo.rollout.protocol import GenerateRequest, SamplingParams, parse_generate_response

    moe = moe_helpers.make_tiny_moe(tmp_path / "moe")  # 6 experts, top-2, 2 layers
    dense = Path(rollout_helpers.make_tiny_llama(str(tmp_path / "dense")))
    configs = {"default": "steps: 1\n", "off": 'steps: 1\nrouting_replay: "off"\n'}  # unquoted, YAML reads off as false
    for name, text in configs.items():
        (tmp_path / f"{name}.yaml").write_text(text)

    def engine(model: Path, mode: str, tp: int = 1, config: str = "default", stage: str = "train") -> str:
        job = job_commands(tmp_path, MODE=mode, ENGINE_TP=str(tp), GPUS_PER_NODE="8", STAGE=stage, Q0_CMD="true",
                           CONFIG=str(tmp_path / f"{config}.yaml"), MODEL_PATH=str(model), SPO_TRAIN_ARGS=f"init.hf={model}")
        assert job["engine"], job["stderr"]
        return job["engine"]

    served = '--port "$ENGINE_PORT"'
    cpu = engine(moe, "cpu")
    assert cpu.startswith("megatron-spo serve ") and cpu.endswith(f"{served} --enable-return-routed-experts")
    gpu = {tp: engine(moe, "gpu", tp) for tp in (2, 4)}
    assert gpu[2].endswith(f"{served} --enable-return-routed-experts --ep-size 2")
    assert gpu[4].endswith(f"{served} --enable-return-routed-experts")
    for model, mode, config, stage in ((dense, "cpu", "default", "train"), (dense, "gpu", "default", "train"),
                                       (moe, "gpu", "off", "train"), (moe, "cpu", "default", "q0")):
        assert engine(model, mode, 2, config, stage).endswith(served), (model.name, mode, config, stage)
    if sgl.sglang_available():
        for tp, ep in ((2, 2), (4, 1)):
            argv = subprocess.run(["bash", "-c", f'eval "set -- {gpu[tp]}"; printf "%s\\0" "$@"'], check=True, text=True,
                                  capture_output=True, env={"PATH": os.environ["PATH"], "MODEL_PATH": str(moe),
                                                            "ENGINE_TP": str(tp), "ENGINE_PORT": "30001"}).stdout
            args = sgl.parse_sglang_server_argv(argv.split("\0")[3:-1])
            assert (args.enable_return_routed_experts, args.tp_size, args.ep_size) == (True, tp, ep)

    def start(port: int) -> subprocess.Popen:  # as launch_workers.sh starts an engine
        env = {**rollout_helpers.engine_env(), "ENGINE_CMD": cpu, "MODEL_PATH": str(moe), "ENGINE_TP": "1",
               "ENGINE_PORT": str(port)}
        return subprocess.Popen(["bash", "-c", 'eval "exec $ENGINE_CMD"'], env=env, start_new_session=True)

    proc, url = rollout_helpers.start_on_free_port(start, "engine")
    try:
        prompt = [5, 6, 7, 8]
        req = GenerateRequest(input_ids=[prompt], sampling_params=SamplingParams(max_new_tokens=4, n=2, temperature=1.0),
                              return_routed_experts=True)
        status, out = post_json(f"{url}/generate", req.to_json(), 60)
        assert status == 200, out
    finally:
        proc.terminate()
        proc.wait(30)
    for c in parse_generate_response(out, 1, 2)[0]:
        tokens = len(prompt) + len(c.output_ids) - 1
        routes = RoutedExperts.from_engine(c.routed_experts, tokens=tokens, top_k=2, where="engine")
        assert routes.array().shape == (tokens, 2, 2) and routes.array().max() < 6


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
