"""A trainer rank that dies (issue 65): `megatron-spo train nproc=2` with one rank killed (SIGKILL) mid-run ends in one
line naming the rank within seconds (never a hang in the survivors' collectives), keeps the last checkpoint, and the
same command resumed from it trains steps that equal an uninterrupted run's (offline data: deterministic)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_layouts import _offline_store, make_odd_models

pytestmark = [pytest.mark.multiproc]
REPO = Path(__file__).resolve().parents[1]


def _config(root: Path, hf: str, name: str, steps: int) -> Path:
    cfg = dict(run_dir=str(root / name), steps=steps, algo="spo", beta=0.5, init={"hf": hf}, nproc=2,
               sources={"offline": {"path": str(root / "offline.jsonl")}}, optimizer={"lr": 1e-3, "warmup_steps": 2},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               checkpoint={"interval": 4, "export_hf": False}, logging={"progress": False})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_spo.cli", "train", str(config)], cwd=REPO, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, **kw)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_rank_fails_the_run_in_one_line_and_the_resumed_run_trains_as_one_not_stopped(tmp_path):
    hf = make_odd_models(tmp_path)["llama"]
    _offline_store(tmp_path / "offline.jsonl")
    whole = _train(_config(tmp_path, hf, "whole", 10))
    out, err = whole.communicate(timeout=600)
    assert whole.returncode == 0, err[-2000:]

    config = _config(tmp_path, hf, "killed", 10)
    proc = _train(config)
    run = tmp_path / "killed"
    deadline = time.monotonic() + 300
    while len(_metrics(run)) < 5:  # past the step-4 checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-2000:]
        time.sleep(0.05)
    helper = next(c for c in _children(proc.pid) if _children(c))  # start_local's helper holds the ranks
    os.kill(_children(helper)[-1], signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 60  # the survivors do not wait out the collectives' timeout (30 min)
    assert proc.returncode == 1
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("megatron-spo")]
    assert lines == ["megatron-spo train: error: rank 1 terminated with signal SIGKILL"], err[-2000:]
    assert (run / "checkpoints" / "iter_0000004").is_dir()

    resumed = _train(config)
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-2000:]
    a, b = _metrics(tmp_path / "whole"), _metrics(run)
    after = {m["step"]: m for m in b if m["step"] > 4}  # the resumed run's steps (the killed run's 5+ were redone)
    assert sorted(after) == list(range(5, 11))
    for m in a[4:]:
        assert after[m["step"]]["loss"] == pytest.approx(m["loss"], rel=1e-6, abs=1e-7)
        assert after[m["step"]]["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-6)
