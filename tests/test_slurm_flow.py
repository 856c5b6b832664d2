"""slurm/submit.sh --flow: from an HF checkpoint and a user's problems JSONL to a trained, evaluated HF checkpoint as
dependent SLURM jobs (convert -> estimate-q0 -> offline build -> [pts] -> train -> eval).

The dry run needs no cluster: every command and dependency printed, nothing created. The whole chain runs for
real on the single-host test cluster (slurm/test_cluster.sh) with a tiny Llama, CPU engines and the real router.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import slurm_helpers
import yaml
from rollout_helpers import CHARS, SPECIALS, make_tiny_llama
from slurm_helpers import SUBMIT, job_info, wait_job

cluster = slurm_helpers.cluster  # the module-scoped fixture: a fresh 4-node cluster for this module

PROBLEMS = [{"id": f"sum{i}", "prompt": f"{i}+{i}=?", "kind": "math", "answer": str(2 * i), "difficulty": i % 3}
            for i in range(6)]


def user_files(root: Path, model: str) -> tuple[Path, Path, Path]:
    """The user's problems JSONL, trajectories JSONL for the offline store (rewards 0 = correct) and config."""
    root.mkdir(parents=True, exist_ok=True)
    problems = root / "my_problems.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    vocab = len(SPECIALS) + len(CHARS)
    rows = [{"prompt_id": f"sum{i % 6}", "prompt_tokens": [3 + (7 * i + k) % (vocab - 3) for k in range(6)],
             "response_tokens": [3 + (11 * i + 5 * k) % (vocab - 3) for k in range(4)] + [2], "reward": 0.0,
             "source": "offline", "policy_version": 0, "provenance": {"kind": "human"}} for i in range(8)]
    trajectories = root / "my_solutions.jsonl"
    trajectories.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "steps": 2, "seed": 3, "beta": 0.5, "model_update_interval": 1, "init": {"hf": None},
        "sources": {"online": {"weight": 0.5, "objective": "terminal", "loss": "squared"},
                    "offline": {"weight": 0.5, "path": None, "objective": "terminal", "loss": "squared"}},
        "optimizer": {"lr": 1e-3, "warmup_steps": 0},
        "batch": {"sequences_per_step": 4, "max_tokens_per_micro_batch": 512, "max_seq_length": 128},
        "rollout": {"samples_per_prompt": 2, "max_new_tokens": 8, "temperature_range": [1.0, 1.0], "top_p": 1.0,
                    "max_inflight_requests": 2, "buffer_groups": 4, "request_timeout_s": 60,
                    "endpoint_cooldown_s": 1.0},
        "task": {"kind": "jsonl", "paths": [str(problems)], "max_prompt_tokens": 100},
        "checkpoint": {"interval": 100, "keep_last": 1},
        "logging": {"progress": False, "wandb_mode": "disabled"},
    }
    config = root / "flow.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return problems, trajectories, config


def flow(model: str, config: Path, run_dir: Path, *args: str, env=None, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SUBMIT), "--flow", "--mode", "cpu", "--model-path", model, "--config",
                           str(config), "--run-dir", str(run_dir), "--time", "30:00", "--trainer-nodes", "1",
                           "--procs-per-node", "1", "--worker-nodes", "1", *args],
                          env=env, check=check, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    model = make_tiny_llama(str(root / "model"), hidden=32, layers=2)
    return (root, model, *user_files(root / "user", model))


def test_dry_run_prints_the_chain_and_creates_nothing(tiny):
    root, model, problems, trajectories, config = tiny
    run_dir = root / "dry"
    out = flow(model, config, run_dir, "--dry-run", "--pts", "--offline-data", str(trajectories),
               "optimizer.lr=2e-3", "steps=3", "--", "--partition=debug").stdout
    assert not run_dir.exists()
    jobs = dict(line.split(" ", 1) for line in out.splitlines() if re.match(r"^[a-z0-9]+ DRYRUN-", line))
    assert list(jobs) == ["convert", "q0", "offline", "pts", "train", "eval"]
    sbatch = {stage: next(line for line in out.splitlines()[i + 1:] if "sbatch" in line)
              for i, line in enumerate(out.splitlines()) for stage in [line.split(" ")[0]] if stage in jobs}
    deps = {stage: re.search(r"--dependency=afterok(\S*)", line) for stage, line in sbatch.items()}
    assert {s: d and d.group(1) for s, d in deps.items()} == {
        "convert": None, "q0": None, "offline": ":DRYRUN-q0", "pts": ":DRYRUN-offline",
        "train": ":DRYRUN-convert:DRYRUN-offline:DRYRUN-pts", "eval": ":DRYRUN-train"}
    assert all("--partition=debug" in line and "--time=30:00" in line for line in sbatch.values())
    assert f"MODEL_PATH={run_dir}/hf" in sbatch["eval"]  # the eval engines serve the trained policy
    train = next(line for line in out.splitlines() if "megatron-spo train" in line)
    assert train.endswith(f"init.hf={model} init.megatron={run_dir}/megatron-init sources.offline.path={run_dir}/offline "
                          f"task.q0_path={run_dir}/q0/q0.jsonl checkpoint.export_hf=true "
                          f"sources.mc.path={run_dir}/pts/pts.jsonl optimizer.lr=2e-3 steps=3")
    assert "megatron-spo validate" in train  # the train stage validates, complete, before it starts anything
    assert f"--task jsonl --data {problems}" in out and str(trajectories) in sbatch["offline"]
    assert out.splitlines()[-1] == f"run_dir {run_dir}"


def test_every_registry_preset_is_taken_with_its_engine_tp(tiny, capsys):
    """slurm/preset.py (what submit.sh asks): every preset the registry knows, its engines' TP from its size."""
    import importlib.util

    from megatron_spo.planning.capacity import BUILTIN_PRESETS

    spec = importlib.util.spec_from_file_location("preset", SUBMIT.parent / "preset.py")
    preset = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(preset)
    tps = {}
    for name in BUILTIN_PRESETS:
        assert preset.main([name]) == 0
        tps[name] = int(capsys.readouterr().out.split()[0])
    assert tps == {"llama3.1-8b": 1, "llama3.1-70b": 8, "qwen2.5-7b": 1, "qwen2.5-32b": 4, "qwen3-8b": 1,
                   "qwen3-32b": 4, "qwen3-30b-a3b": 2, "qwen3-235b-a22b": 8}  # MoE: every expert's weights
    root, model, _, _, config = tiny
    out = flow(model, config, root / "dry", "--dry-run", "--preset", "qwen3-32b").stdout
    assert out.splitlines()[0] == f"preset qwen3-32b: engine TP 4, config {config}, model {model}"


def test_bad_flow_arguments_fail_before_anything_in_one_line(tiny):
    root, model, _, _, config = tiny
    cases = [
        (["--model-path", "", "--dry-run"], "submit.sh: --model-path is required: the HF directory the engines "
                                            "serve and the trainer starts from"),
        (["--dry-run", "--preset", "gpt5"], "submit.sh: --preset: unknown model preset 'gpt5' (known: llama3.1-70b, "
                                            "llama3.1-8b, qwen2.5-32b, qwen2.5-7b, qwen3-235b-a22b, qwen3-30b-a3b, "
                                            "qwen3-32b, qwen3-8b)"),
        (["--dry-run", "--q0"], "submit.sh: --flow already has its Q0 stage: drop --q0 / --q0-only"),
        (["--dry-run", "--offline-data", "/no/such.jsonl"], "submit.sh: --offline-data: no such file or store "
                                                           "'/no/such.jsonl'"),
    ]
    for args, message in cases:
        out = flow(model, config, root / "bad", *args, check=False)
        assert (out.returncode, out.stderr.strip()) == (2, message)
    out = subprocess.run(["bash", str(SUBMIT), "--mode", "cpu", "--pts"], capture_output=True, text=True)
    assert out.stderr.strip().startswith("submit.sh: --pts, --offline-data") and not (root / "bad").exists()


@pytest.mark.multiproc
@pytest.mark.slow
def test_the_whole_flow_from_a_hf_checkpoint_and_user_jsonl_to_an_evaluated_hf_checkpoint(cluster, tiny):
    root, model, problems, trajectories, config = tiny
    run_dir = cluster["root"] / "flow"
    out = flow(model, config, run_dir, "--offline-data", str(trajectories), "--engines-per-node", "1",
               "--q0-args", "--samples 4 --samples-per-request 2 --concurrency 1 --max-new-tokens 6 --no-progress",
               "--eval-args", "-n 2 --ks 1 2 --max-new-tokens 6 --concurrency 1", env=cluster["env"]).stdout
    jobs = dict(line.split(" ", 1) for line in out.splitlines())
    assert list(jobs) == ["convert", "q0", "offline", "train", "eval", "run_dir"]
    wait_job(cluster, jobs["eval"], 600)
    logs = "\n".join(f"==> {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted((run_dir / "logs").iterdir()))
    states = {stage: [c["JobState"] for c in job_info(cluster, jobs[stage])] for stage in jobs if stage != "run_dir"}
    if not all(set(s) == {"COMPLETED"} for s in states.values()):
        print(logs)  # shown whole with the failure
        pytest.fail(f"stages did not all complete: {states}")
    assert (run_dir / "megatron-init").is_dir() and (run_dir / "offline").is_dir()
    assert len((run_dir / "q0" / "q0.jsonl").read_text().splitlines()) == len(PROBLEMS)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())  # the trainer's resolved config: stages wired in
    assert saved["init"] == {"hf": model, "megatron": str(run_dir / "megatron-init")}
    assert saved["sources"]["offline"]["path"] == str(run_dir / "offline")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (run_dir / "hf" / "config.json").is_file() and list((run_dir / "hf").glob("*.safetensors"))
    result = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert len(result["problems"]) == len(PROBLEMS), result


def test_a_config_that_does_not_validate_is_refused_before_anything_is_submitted(tiny, tmp_path):
    """submit.sh runs `megatron-spo validate` first: a layout the model cannot take is named and nothing reaches
    sbatch (a stand-in that records its calls); the flow's own future outputs are not counted as problems."""
    root, model, _, trajectories, config = tiny
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls"
    (bin_dir / "sbatch").write_text(f"#!/bin/bash\necho \"$*\" >> {calls}\necho 7\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = flow(model, config, tmp_path / "run", "parallel.tensor_model_parallel_size=3", env=env, check=False)
    assert out.returncode == 2 and not calls.exists() and not (tmp_path / "run").exists(), out.stderr
    assert "parallel.tensor_model_parallel_size" in out.stderr
    assert out.stderr.strip().splitlines()[-1] == "submit.sh: the config does not validate (above): nothing submitted"
    out = flow(model, config, tmp_path / "run", "--offline-data", str(trajectories), env=env)
    assert [line.split()[0] for line in out.stdout.splitlines()] == ["convert", "q0", "offline", "train", "eval",
                                                                     "run_dir"]
    assert len(calls.read_text().splitlines()) == 5
