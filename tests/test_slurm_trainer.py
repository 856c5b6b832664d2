"""The real trainer under the project's sbatch script, on a real single-host SLURM cluster.

slurm/submit.sh --mode cpu with the default TRAIN_CMD (`megatron-spo train CONFIG run_dir=... checkpoint.dir=...`)
and the default CPU ENGINE_CMD (`megatron-spo serve`): one trainer node x 2 ranks (TP=2, gloo over
MASTER_ADDR/MASTER_PORT) + one worker node with local engines behind the real sglang-router. The trainer
mixes online rollouts of the toy code task (scored in the sandbox) with an offline JSONL source, and pushes
its weights to every engine (gloo broadcast group) every model_update_interval steps.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import slurm_helpers
import yaml
from rollout_helpers import CHARS, SPECIALS, make_tiny_llama
from slurm_helpers import SUBMIT, batch_log, job_info, wait_job

cluster = slurm_helpers.cluster  # the module-scoped fixture: a fresh 4-node cluster for this module


def test_sandbox_children_inherit_ignored_preemption_signals():
    """srun delivers SIGUSR1 to every process of the step: what the trainer starts inside the guard (its
    reward sandbox) ignores it and SIGTERM; the trainer's own handlers are restored after."""
    from megatron_spo.run_layout import children_ignore_preemption_signals

    probe = [sys.executable, "-c", "import signal; print(int(signal.getsignal(signal.SIGUSR1)), "
             "int(signal.getsignal(signal.SIGTERM)))"]
    before = signal.getsignal(signal.SIGUSR1)
    with children_ignore_preemption_signals():
        inside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()
    outside = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()
    assert inside == [str(int(signal.SIG_IGN))] * 2
    assert outside == [str(int(signal.SIG_DFL))] * 2
    assert signal.getsignal(signal.SIGUSR1) == before


def test_first_weight_push_waits_for_engines_and_names_the_missing_one():
    from megatron_spo.net import free_port
    from megatron_spo.training.online import wait_healthy

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as err:
        wait_healthy([url], timeout_s=0.3, poll_s=0.1)
    assert str(err.value).startswith(f"rollout engines not healthy after 0 s: {url} (")


@pytest.fixture(scope="module")
def model_dir(cluster):
    """A tiny random Llama with a character tokenizer: the engines' model and the trainer's init.hf."""
    return make_tiny_llama(str(cluster["root"] / "model"), hidden=32, layers=2)


def offline_jsonl(path: Path) -> Path:
    """12 trajectories in 6 prompt groups (tokens of the tiny model's vocabulary), rewards in {0, -1}."""
    vocab = len(SPECIALS) + len(CHARS)
    rows = []
    for i in range(12):
        prompt = [3 + (7 * i + k) % (vocab - 3) for k in range(6)]
        response = [3 + (11 * i + 5 * k) % (vocab - 3) for k in range(4 + i % 4)] + [2]
        rows.append({"prompt_id": f"off-{i // 2}", "prompt_tokens": prompt, "response_tokens": response,
                     "reward": -float(i % 2), "source": "offline", "policy_version": 0, "q0": -0.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def toy_q0(path: Path, toy: dict) -> Path:
    """A q0 file (S0 = 1/2 at n = 4) for every training prompt of the toy task ``toy`` (a --q0 stage's output
    replaces it through task.q0_path)."""
    from megatron_spo.data.problems import problems_from_task_config
    from megatron_spo.data.q0 import q0_from_counts
    from megatron_spo.training.config import TrainConfig

    task = TrainConfig.model_validate({"init": {"hf": "x"}, "task": {"kind": "toy", "toy": toy}}).task
    est = q0_from_counts(2, 4, 0.5)
    path.write_text("".join(json.dumps({"prompt_id": p.id, "s0": est.s0, "q0": est.q0, "n": 4, "correct": 2,
                                        "beta": 0.5}) + "\n" for p in problems_from_task_config(task)))
    return path


def train_config(root: Path, model: str, name: str, *, steps: int, interval: int) -> Path:
    """A tiny TrainConfig: 2 online groups x 2 samples + 2 offline sequences per step, TP=2."""
    cfg = {
        "steps": steps, "seed": 3, "beta": 0.5, "model_update_interval": 2,
        "init": {"hf": model},
        "parallel": {"tensor_model_parallel_size": 2},
        "sources": {"online": {"weight": 0.5, "objective": "terminal", "loss": "squared"},
                    "offline": {"weight": 0.5, "path": str(offline_jsonl(root / f"{name}-offline.jsonl")),
                                "objective": "reverse_q", "loss": "squared"}},
        "optimizer": {"lr": 1e-3, "warmup_steps": 0},
        "batch": {"sequences_per_step": 4, "max_tokens_per_micro_batch": 256, "max_seq_length": 128},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 12, "temperature_range": [1.0, 1.0],
                    "max_inflight_requests": 2, "buffer_groups": 4, "request_timeout_s": 60,
                    "endpoint_cooldown_s": 1.0},
        "task": {"kind": "toy", "toy": {"num_problems": 24},
                 "q0_path": str(toy_q0(root / f"{name}-q0.jsonl", {"num_problems": 24}))},  # SPO needs Q0
        "sandbox": {"slots": 1, "time_limit_s": 1.0, "memory_mb": 256, "prestart": False},
        "checkpoint": {"interval": interval, "keep_last": 2},
        "logging": {"progress": False, "wandb_mode": "disabled"},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def submit(cluster, run_dir: Path, config: Path, model: str, *args: str, **env_extra: str) -> dict[str, str]:
    env = dict(cluster["env"], **env_extra)
    out = subprocess.run(["bash", str(SUBMIT), "--mode", "cpu", "--config", str(config), "--model-path", model,
                          "--run-dir", str(run_dir), "--time", "30:00", "--trainer-nodes", "1",
                          "--procs-per-node", "2", "--worker-nodes", "1", *args],
                         env=env, check=True, capture_output=True, text=True, timeout=60)
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def logs(run_dir: Path) -> str:
    """Every log of the run (for failure messages): the tail of each file."""
    return "\n".join(f"==> {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                     for p in sorted((run_dir / "logs").iterdir()))


@pytest.mark.multiproc
@pytest.mark.slow
def test_q0_preempted_then_trainer_job_trains_pushes_weights_checkpoints_and_exports(cluster, model_dir):
    """The Q0 stage (real estimate-q0 through the router) gets SIGUSR1 mid-run (the time-limit warning): it
    saves the prompts it finished, is requeued and resumes; the training job waiting on it (afterok) is not
    cancelled and then runs 4 steps with its q0, checkpoints every 2, weights to both engines every 2 steps,
    the final policy exported."""
    root = cluster["root"]
    run_dir = root / "run_train"
    config = train_config(root, model_dir, "train", steps=4, interval=2)
    q0_cmd = ('megatron-spo estimate-q0 "$CONFIG" --router-url "$SPO_ROUTER_URL" --out "$SPO_Q0_DIR" '
              "--samples 8 --samples-per-request 2 --concurrency 1 --max-new-tokens 8 --sandbox-slots 1 "
              "--no-progress")
    jobs = submit(cluster, run_dir, config, model_dir, "--engines-per-node", "2", "--q0", Q0_CMD=q0_cmd)
    q0_file = run_dir / "q0" / "q0.jsonl"

    def q0_lines() -> int:
        return q0_file.read_text().count("\n") if q0_file.exists() else 0

    wait_job(cluster, jobs["q0"], 240, until=lambda: q0_lines() >= 1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", jobs["q0"]], env=cluster["env"], check=True)
    # the requeued Q0 stage redoes its unfinished prompts, then the trainer job starts its engines and trains: on an
    # idle 2-core machine 472 s from the signal with 16 samples a prompt (2026-11-28), so 8 samples and 600 s
    info = wait_job(cluster, jobs["train"], 600)
    q0 = job_info(cluster, jobs["q0"])
    assert [c["JobState"] for c in q0] == ["COMPLETED", "COMPLETED"], logs(run_dir)
    assert q0[0]["Restarts"] == "1", logs(run_dir)
    q0_log = (run_dir / "logs" / "q0.log").read_text()
    assert "estimate-q0: stopped by SIGUSR1" in q0_log and f"requeueing job {jobs['q0']}" in batch_log(run_dir)
    assert [c["JobState"] for c in info] == ["COMPLETED", "COMPLETED"], logs(run_dir)
    assert info[0]["Restarts"] == "0"
    q0_rows = [json.loads(line) for line in q0_file.read_text().splitlines()]
    assert len(q0_rows) == 12 and all(r["n"] == 8 for r in q0_rows)  # the toy task's 12 training prompts (24, half held out)

    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == [1, 2, 3, 4], logs(run_dir)
    # version k after the k-th push (steps 2 and 4); both engines took each push (no failed sync)
    assert [m["policy_version"] for m in rows] == [0.0, 1.0, 1.0, 2.0]
    pushes = [rows[i] for i in (1, 3)]
    assert all(m["weight_sync/engines_updated"] == 2 and m["weight_sync/engines_failed"] == 0 for m in pushes)
    assert all(0 < m["weight_sync/pause_seconds"] <= m["weight_sync/seconds"] for m in pushes)
    assert not any("weight_sync/failed" in m for i, m in enumerate(rows) if i not in (1, 3))
    assert all(m["rollout/groups"] >= 1 for m in rows)  # online groups were generated by the engines
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_0000004"
    assert {p.name for p in ckpts.glob("iter_*") if (p / "COMPLETE").exists()} == {"iter_0000002", "iter_0000004"}
    hf = run_dir / "hf"
    assert (hf / "config.json").is_file() and list(hf.glob("*.safetensors")) and (hf / "tokenizer.json").is_file()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())  # the trainer's resolved config
    assert saved["run_dir"] == str(run_dir) and saved["checkpoint"]["dir"] == str(ckpts)
    assert saved["task"]["q0_path"] == str(run_dir / "q0" / "q0.jsonl")  # the Q0 stage's output, wired in
    assert f"Q0 estimates: {run_dir / 'q0' / 'q0.jsonl'} (passed as task.q0_path)" in batch_log(run_dir)

    names = {p.name for p in (run_dir / "logs").iterdir()}
    engine_logs = sorted(n for n in names if n.startswith("engine-"))
    assert {"trainer-rank0.log", "trainer-rank1.log", "workers-node0.log", "router.log", "q0.log"} <= names
    assert len(engine_logs) == 2
    for name in engine_logs:  # each engine received both pushes, directly (the router does not proxy them)
        text = (run_dir / "logs" / name).read_text()
        assert "Weight version updated to 1." in text and "Weight version updated to 2." in text, text[-2000:]
    rank0 = (run_dir / "logs" / "trainer-rank0.log").read_text()
    assert "final policy written to" in rank0
    assert "trainer finished" in batch_log(run_dir)


@pytest.mark.multiproc
@pytest.mark.slow
def test_trainer_preempted_checkpoints_requeues_and_resumes(cluster, model_dir):
    """SIGUSR1 to the batch shell mid-run: checkpoint at the stop step, requeue, resume from it, complete."""
    root = cluster["root"]
    run_dir = root / "run_preempt"
    steps = 16
    config = train_config(root, model_dir, "preempt", steps=steps, interval=100)  # only the signal checkpoints
    jobs = submit(cluster, run_dir, config, model_dir)
    job = jobs["train"]
    wait_job(cluster, job, 420, until=lambda: len(metrics(run_dir)) >= 2)  # the job starts engines and ranks: slow beside other work
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=cluster["env"], check=True)
    info = wait_job(cluster, job, 300)
    log = batch_log(run_dir)
    assert [c["JobState"] for c in info] == ["COMPLETED", "COMPLETED"], logs(run_dir)
    assert info[0]["Restarts"] == "1", logs(run_dir)
    assert "SIGUSR1 (time limit or preemption)" in log and f"requeueing job {job}" in log

    rank0 = (run_dir / "logs" / "trainer-rank0.log").read_text()
    stopped = re.findall(r"preempted: checkpoint at step (\d+) saved, exiting", rank0)
    assert len(stopped) == 1, rank0[-3000:]
    k = int(stopped[0])
    assert 2 <= k < steps
    assert f"resumed from {run_dir / 'checkpoints' / f'iter_{k:07d}'} at step {k}" in rank0
    assert f"resuming from iter_{k:07d}" in log  # the batch shell of the restart saw the same checkpoint

    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == list(range(1, steps + 1))  # continues, never restarts or repeats
    # srun hands the signal to every process of the step: the reward sandbox outlived it (no failed rewards)
    assert all(m["rollout/reward_errors"] == 0 for m in rows), [m["rollout/reward_errors"] for m in rows]
    # the resumed run re-sent its weights first (version unchanged), then pushed every 2 steps as before
    assert [m["policy_version"] for m in rows] == [float(s // 2) for s in range(1, steps + 1)]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / f"iter_{k:07d}" / "COMPLETE").exists()
    assert (ckpts / "latest").read_text().strip() == f"iter_{steps:07d}"
    assert (run_dir / "hf" / "config.json").is_file()
    assert job_info(cluster, job)[0]["JobState"] == "COMPLETED"
