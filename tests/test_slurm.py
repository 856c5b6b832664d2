"""The project's sbatch script on a real SLURM cluster (munged + slurmctld + 4 slurmds on this host).

slurm/probe.py stands in for the trainer, the engines and the Q0 driver (tests/test_slurm_trainer.py runs the
real ones); the router is the real sglang-router. What is proven: the heterogeneous layout
and its env contract (ranks, MASTER_ADDR/PORT through a real gloo rendezvous, router and engine URLs),
the Q0 stage ordered before training by afterok, per-component logs, preemption (SIGUSR1 -> checkpoint ->
requeue -> resume continuing the step counter), an engine that dies restarted and the job failing fast once none is
left, and submit.sh's container (pyxis) options on every srun with its env file sourced by every rank and engine.
Without a cluster: the engine command spo.sbatch builds for a mixture-of-experts run (the routed-experts flags) and a
dense one (none); the srun options and env file of every step; launch_workers.sh bringing back engines that die.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
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
    """An engine that keeps exiting is restarted ENGINE_RESTARTS times, then dropped; with no engine left on the only
    worker node the trainer is stopped and the job fails, naming the component and its logs."""
    run_dir = cluster["root"] / "run_c"
    jobs = submit(cluster, run_dir, "--trainer-nodes", "1", "--worker-nodes", "1", ENGINE_RESTARTS="1",
                  ENGINE_CMD="bash -c 'echo engine crashed; exit 3'", PROBE_TRAIN_ARGS="--steps 1000")
    start = time.monotonic()
    info = wait_job(cluster, jobs["train"], 60)
    assert time.monotonic() - start < 45
    assert info[0]["JobState"] == "FAILED"
    log = batch_log(run_dir)
    assert "ERROR: worker component died (exit 3) while the trainer was running" in log
    workers_log = (run_dir / "logs" / "workers-node0.log").read_text()
    engine = re.search(r"ERROR: engine 0 \((http://127\.0\.0\.1:\d+), (\S+)\) exited with status 3: ", workers_log)
    assert engine, workers_log
    assert f"ERROR: engine 0 ({engine[1]}, {engine[2]}) exited with status 3: restarting it on its GPUs and port " \
           "(restart 1 of 1)" in workers_log
    assert f"ERROR: engine 0 ({engine[1]}, {engine[2]}) exited with status 3: dropped after 1 restarts " \
           "(ENGINE_RESTARTS); 0 engine(s) left on this node" in workers_log
    assert "ERROR: no engine left on the only worker node: stopping" in workers_log
    assert metrics(run_dir) == []


def test_container_options_reach_every_srun_and_the_env_file_every_rank(cluster, tmp_path):
    """submit.sh --container-image/--container-mounts/--container-workdir on a cluster without pyxis: an srun stand-in
    first on PATH records the pyxis options each srun of the job is given, drops them and runs the real srun. Every
    srun (workers, trainer) got them; every trainer rank and engine found the --env-file's settings in its
    environment (sourced on its node), a value computed there included."""
    run_dir = cluster["root"] / "run_d"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = subprocess.run(["bash", "-c", "command -v srun"], env=cluster["env"], capture_output=True, text=True,
                          check=True).stdout.strip()
    (bin_dir / "srun").write_text(f"""#!/bin/bash
args=() seen=()
for a in "$@"; do case "$a" in --container-*|--no-container-*) seen+=("$a") ;; *) args+=("$a") ;; esac; done
line="$(printf '%s\x1f' "${{seen[@]}}")"
printf '%s\n' "$line" >> "{tmp_path}/sruns"  # one write: the job's two sruns run at once
exec {real} "${{args[@]}}"
""")
    (bin_dir / "srun").chmod(0o755)
    env_file = tmp_path / "nccl.env"
    env_file.write_text("# the cluster's network\nNCCL_SOCKET_IFNAME=lo\nexport NCCL_IB_HCA=mlx5_0\n"
                        "GLOO_SOCKET_IFNAME=lo\nNCCL_TOPO_NODE=$(hostname)\n")
    jobs = submit(cluster, run_dir, "--trainer-nodes", "1", "--worker-nodes", "1", "--container-image",
                  "nvcr.io#nvidia/pytorch:25.01-py3", "--container-mounts", "/data:/data:ro", "--env-file",
                  str(env_file), PATH=f"{bin_dir}:{cluster['env']['PATH']}", PROBE_TRAIN_ARGS="--steps 2")
    info = wait_job(cluster, jobs["train"], 120)
    assert [c["JobState"] for c in info] == ["COMPLETED", "COMPLETED"], batch_log(run_dir)
    pyxis = ["--container-image=nvcr.io#nvidia/pytorch:25.01-py3", "--no-container-mount-home",
             f"--container-workdir={REPO}", f"--container-mounts=/data:/data:ro,{REPO}:{REPO},{run_dir}:{run_dir}"]
    sruns = [line.split("\x1f")[:-1] for line in (tmp_path / "sruns").read_text().splitlines()]
    assert sruns == [pyxis, pyxis]  # the workers' srun and the trainer's
    assert (run_dir / "env.sh").read_text() == env_file.read_text()  # the job read the copy in its run directory
    envs = [read_env(run_dir, "trainer-rank0-restart0")] + [
        json.loads(p.read_text()) for p in (run_dir / "probe").glob("env-engine-*.json")]
    assert len(envs) == 2
    for rec in envs:
        assert {k: rec["env"].get(k) for k in ("NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME")} == {
            "NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_HCA": "mlx5_0", "GLOO_SOCKET_IFNAME": "lo"}
        assert rec["env"]["NCCL_TOPO_NODE"] == rec["hostname"]
    assert f"env file (sourced by every rank and engine worker): {run_dir}/env.sh" in batch_log(run_dir)


# -- without a cluster: submit.sh's container and env-file options, the sruns they reach, engines that come back --
PYXIS_ARGS = ("--container-image", "nvcr.io#nvidia/pytorch:25.01-py3", "--container-mounts", "/data:/data:ro,/scratch",
              "--container-workdir", "/workspace")


def test_submit_dry_run_shows_the_container_and_env_file_on_every_srun(tmp_path):
    env_file = tmp_path / "nccl.env"
    env_file.write_text("# InfiniBand\nexport NCCL_SOCKET_IFNAME=ib0\nNCCL_IB_HCA=mlx5_0,mlx5_1\n\nGLOO_SOCKET_IFNAME=eth0\n")
    run_dir = tmp_path / "run"
    out = subprocess.run(["bash", str(SUBMIT), "--mode", "cpu", "--probe", "--q0", "--dry-run", "--run-dir", str(run_dir),
                          *PYXIS_ARGS, "--env-file", str(env_file)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pyxis = (f"srun --container-image=nvcr.io#nvidia/pytorch:25.01-py3 --no-container-mount-home "
             f"--container-workdir=/workspace --container-mounts=/data:/data:ro,/scratch,{REPO}:{REPO},{run_dir}:{run_dir}")
    lines = out.stdout.splitlines()
    assert f"container (pyxis, every srun of every job): {pyxis[len('srun '):]}" in lines
    at = lines.index(f"env file (every trainer rank and engine worker sources it before it starts): {run_dir}/env.sh, "
                     f"a copy of {env_file}:")
    assert lines[at + 1:at + 4] == ["  export NCCL_SOCKET_IFNAME=ib0", "  NCCL_IB_HCA=mlx5_0,mlx5_1",
                                    "  GLOO_SOCKET_IFNAME=eth0"]
    for job in ("q0", "train"):  # each job's sbatch line, then what every srun of it gets
        at = lines.index(f"{job} DRYRUN-{job}")
        assert lines[at + 2:at + 4] == [f"  every srun: {pyxis} ...",
                                        f"  every rank, engine worker and stage command first sources {run_dir}/env.sh"]
    assert not run_dir.exists()  # a dry run creates nothing


def test_submit_refuses_a_missing_env_file_and_malformed_mounts_in_one_line(tmp_path):
    bad_shell = tmp_path / "bad.env"
    bad_shell.write_text("NCCL_IB_HCA=(mlx5_0\n")
    cases = [
        (["--env-file", "/no/such.env"], "--env-file: no such file '/no/such.env'"),
        (["--env-file", str(bad_shell)], f"--env-file: '{bad_shell}' is not a file bash can source ({bad_shell}: "),
        (["--container-mounts", "/data:/data"], "--container-mounts and --container-workdir need --container-image"),
        (["--container-image", "img", "--container-workdir", "work"],
         "--container-workdir must be an absolute path, got 'work'"),
    ]
    for mount in ("data:/data", "/data:", "/data:data", "/data:/data:ro:x", "/a,,/b", "/a,"):
        cases.append((["--container-image", "img", "--container-mounts", mount],
                      f"--container-mounts: '{mount.split(',')[1] if ',' in mount else mount}' is not "
                      "SRC[:DST[:FLAGS]] with absolute paths (e.g. /data:/data:ro)"))
    for args, message in cases:
        out = subprocess.run(["bash", str(SUBMIT), "--mode", "cpu", "--probe", "--dry-run", *args], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, (args, out.stderr)
        assert out.stderr.startswith(f"submit.sh: {message}"), (args, out.stderr)


def test_every_srun_of_a_job_gets_the_container_options_and_every_step_the_env_file(tmp_path):
    """spo.sbatch (each stage's sruns: the workers' and the trainer's or the driver's) and stage.sbatch (one srun with a
    container, none without) under srun stand-ins; the stage's command sees the env file's settings."""
    mounts = f"/data:/data:ro,{REPO}:{REPO}"
    pyxis = ["--container-image=img.sqsh", "--no-container-mount-home", f"--container-workdir={REPO}",
             f"--container-mounts={mounts}"]
    env_file = tmp_path / "env.sh"
    env_file.write_text("NCCL_SOCKET_IFNAME=ib0\n")
    container = {"SPO_CONTAINER_IMAGE": "img.sqsh", "SPO_CONTAINER_MOUNTS": mounts, "SPO_ENV_FILE": str(env_file)}
    for stage, driver in (("train", "TRAIN_CMD"), ("q0", "Q0_CMD"), ("eval", "EVAL_CMD")):
        job = job_commands(tmp_path, MODE="cpu", STAGE=stage, **{driver: "true"}, **container)
        assert len(job["sruns"]) == 2 and all(argv[:4] == pyxis for argv in job["sruns"]), (stage, job)
        assert sorted(argv[4] for argv in job["sruns"]) == ["--het-group=0", "--het-group=1"]  # driver, workers
    plain = job_commands(tmp_path, MODE="cpu", STAGE="train", TRAIN_CMD="true")
    assert len(plain["sruns"]) == 2 and not any(a.startswith("--container") for argv in plain["sruns"] for a in argv)
    missing = job_commands(tmp_path, MODE="cpu", STAGE="train", TRAIN_CMD="true", SPO_ENV_FILE="/no/such.env")
    assert missing["sruns"] == [] and missing["stderr"].strip().endswith(
        "ERROR: SPO_ENV_FILE='/no/such.env' (submit.sh --env-file) is not readable")

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/bin/bash\n" 'printf "%s\\n" "$@" > "$OUT/srun"\n'  # its options, then run the rest
                                  'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    stage = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SPO_HOME": str(REPO), "RUN_DIR": str(tmp_path / "run"),
             "OUT": str(tmp_path), "STAGE": "convert", "STAGE_CMD": 'echo "$NCCL_SOCKET_IFNAME" > "$OUT/seen"'}
    for extra in ({"SPO_ENV_FILE": str(env_file)}, container):
        (tmp_path / "srun").unlink(missing_ok=True)
        out = subprocess.run(["bash", str(REPO / "slurm" / "stage.sbatch")], env={**stage, **extra}, capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert (tmp_path / "seen").read_text() == "ib0\n"
        if extra is container:  # in the container: one srun step
            assert (tmp_path / "srun").read_text().splitlines()[:6] == pyxis + ["--nodes=1", "--ntasks=1"]
        else:
            assert not (tmp_path / "srun").exists()


def test_every_trainer_rank_sources_the_env_file_on_its_node(tmp_path):
    env_file = tmp_path / "env.sh"
    env_file.write_text("NCCL_SOCKET_IFNAME=ib0\nNCCL_IB_HCA=mlx5_$SLURM_LOCALID\n")  # a value computed per rank
    rank = {"PATH": os.environ["PATH"], "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
            "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "n1", "SPO_ENV_FILE": str(env_file)}
    out = subprocess.run(["bash", str(REPO / "slurm" / "launch_rank.sh"), 'echo "$NCCL_SOCKET_IFNAME $NCCL_IB_HCA $RANK"'],
                         env=rank, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ib0 mlx5_1 1", out.stderr
    out = subprocess.run(["bash", str(REPO / "slurm" / "launch_rank.sh"), "true"],
                         env={**rank, "SPO_ENV_FILE": "/no/such.env"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stderr.strip() == (
        "launch_rank.sh: ERROR: SPO_ENV_FILE='/no/such.env' (submit.sh --env-file) is not readable on "
        f"{socket.gethostname()}")


def test_launch_workers_restarts_a_dead_or_hung_engine_keeps_the_others_and_drops_it_after_the_last_try(tmp_path):
    """launch_workers.sh with two stub engines (slurm/probe.py) and the real router: engine 1 SIGKILLed is started
    again on its port, leaves the router at once and rejoins it only once it holds the weight version engine 0 holds,
    while engine 0 keeps running; engine 0 stopped (SIGSTOP) is killed by its health watch and restarted; engine 1
    killed past ENGINE_RESTARTS is dropped in one line and taken out of the router, and the node goes on; the router
    killed is started again; SIGTERM stops everything it started. Every engine sees the env file's settings."""
    import psutil

    from megatron_spo.net import free_port
    from megatron_spo.rollout.client import get_json, post_json
    from megatron_spo.rollout.fleet import router_workers

    ports = [free_port() for _ in range(4)]
    urls = [f"http://127.0.0.1:{p}" for p in ports[:2]]
    router = f"http://127.0.0.1:{ports[2]}"
    (tmp_path / "logs").mkdir()
    env_file = tmp_path / "env.sh"
    env_file.write_text("NCCL_SOCKET_IFNAME=ib0\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SPO_"))}, "SLURM_NODEID": "0", "SLURMD_NODENAME": "n1", "MODE": "cpu", "ENGINES_PER_NODE": "2",
           "ENGINE_TP": "1", "GPUS_PER_NODE": "1", "SPO_ENGINE_URLS": ",".join(urls), "SPO_ROUTER_URL": router,
           "LOG_DIR": str(tmp_path / "logs"), "SPO_RUN_DIR": str(tmp_path), "SPO_ENV_FILE": str(env_file),
           "ENGINE_RESTARTS": "1", "ENGINE_HEALTH_INTERVAL_S": "0.2", "ENGINE_HEALTH_TIMEOUT_S": "0.5",
           "ENGINE_HEALTH_FAILURES": "3", "PYTHONPATH": str(REPO),
           "ENGINE_CMD": f'{sys.executable} slurm/probe.py engine --host 127.0.0.1 --port "$ENGINE_PORT"',
           "ROUTER_CMD": f"{sys.executable} -m megatron_spo.cli router --host 127.0.0.1 --port {ports[2]} --worker-urls "
                         f"{' '.join(urls)} --policy round_robin --log-level warn --prometheus-host 127.0.0.1 "
                         f"--prometheus-port {ports[3]}"}
    log_path = tmp_path / "workers.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(["bash", str(REPO / "slurm" / "launch_workers.sh")], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def until(condition, what: str, timeout_s: float = 120.0) -> None:
            deadline = time.monotonic() + timeout_s
            while not condition():
                assert proc.poll() is None and time.monotonic() < deadline, f"{what}:\n{log_path.read_text()}"
                time.sleep(0.05)

        def pid(i: int) -> int:  # the engine's latest start
            return int(re.findall(rf"engine {i} on cpu at {urls[i]} \(pid (\d+),", log_path.read_text())[-1])

        def listed() -> list[str]:
            try:
                return sorted(router_workers(router))
            except OSError:
                return []

        def answers(url: str) -> bool:
            try:
                return get_json(url + "/health", 2)[0] == 200
            except OSError:
                return False

        until(lambda: listed() == sorted(urls), "the router lists both engines")
        assert post_json(urls[0] + "/update_weight_version", {"new_version": "4"})[0] == 200  # a push engine 1 missed
        first = [pid(0), pid(1)]
        os.kill(first[1], signal.SIGKILL)
        until(lambda: pid(1) != first[1] and answers(urls[1]), "engine 1 restarted on its port")
        until(lambda: listed() == [urls[0]], "engine 1 out of the router: it holds the launch weights")
        assert pid(0) == first[0] and answers(urls[0])  # the other engine kept running
        assert post_json(urls[1] + "/update_weight_version", {"new_version": "4"})[0] == 200  # the next push
        until(lambda: listed() == sorted(urls), "engine 1 back in the router")

        os.kill(first[0], signal.SIGSTOP)
        until(lambda: pid(0) != first[0] and answers(urls[0]), "the hung engine 0 killed and restarted")

        second = pid(1)
        os.kill(second, signal.SIGKILL)
        until(lambda: "dropped after" in log_path.read_text(), "engine 1 dropped")
        until(lambda: urls[1] not in listed(), "engine 1 out of the router")
        assert proc.poll() is None and answers(urls[0])  # the node goes on with engine 0 and the router

        router_pid = int(re.findall(r"sglang-router at \S+ over 2 engines \(pid (\d+),", log_path.read_text())[-1])
        os.kill(router_pid, signal.SIGKILL)
        until(lambda: "router (" in log_path.read_text() and urls[0] in listed(), "the router restarted, engine 0 in it")
        text = log_path.read_text()
        assert f"ERROR: router ({router}) exited with status 137: restarting it (restart 1 of 1)" in text
        log0, log1 = (f"{tmp_path}/logs/engine-n1-{i}.log" for i in (0, 1))
        assert (f"ERROR: engine 1 ({urls[1]}, {log1}) exited with status 137: restarting it on its GPUs and port "
                "(restart 1 of 1)") in text
        assert f"fleet rejoin: {urls[1]} back in the router at weight version 4" in text
        assert f"fleet watch: {urls[0]} stopped answering (3 health checks in a row failed): killed pid {first[0]}" in text
        assert f"ERROR: engine 0 ({urls[0]}, {log0}) exited with status 137: restarting it" in text
        assert (f"ERROR: engine 1 ({urls[1]}, {log1}) exited with status 137: dropped after 1 restarts "
                "(ENGINE_RESTARTS); 1 engine(s) left on this node") in text
        for port in ports[:2]:
            assert json.loads((tmp_path / "probe" / f"env-engine-n1-{port}.json").read_text())[
                "env"]["NCCL_SOCKET_IFNAME"] == "ib0"
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.terminate()
        assert proc.wait(timeout=60) == 0
        psutil.wait_procs(children, timeout=30)
        assert [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
