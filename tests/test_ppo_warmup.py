"""PPO's critic warm-up (ppo.critic_warmup_steps, verl's critic_warmup): the first steps train only the value
model, so the policy's first update uses a value model that has seen data instead of a zero head."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from models_helpers import all_tensors  # noqa: E402
from trainer_helpers import make_tiny_hf, run_spawned  # noqa: E402

pytestmark = [pytest.mark.multiproc]


def test_warmup_steps_leave_the_policy_untouched_then_it_trains(tmp_path):
    hf = make_tiny_hf(str(tmp_path / "hf"))
    cfg = dict(run_dir=str(tmp_path / "run"), steps=3, algo="ppo", beta=0.5, init={"hf": hf},
               optimizer={"lr": 1e-3, "warmup_steps": 0}, ppo={"critic_warmup_steps": 2},
               rollout={"temperature_range": [1.0, 1.0], "top_p": 1.0},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               model_update_interval=1, checkpoint={"interval": 100, "export_hf": False}, logging={"progress": False})
    warm = dict(cfg, steps=2, run_dir=str(tmp_path / "warm"))
    run_spawned([(warm, str(tmp_path / "after2.pt")), (cfg, str(tmp_path / "after3.pt"))], 1)
    initial = all_tensors(Path(hf))
    after2, after3 = torch.load(tmp_path / "after2.pt"), torch.load(tmp_path / "after3.pt")
    assert all(torch.equal(after2[k], initial[k]) for k in initial)  # two warm-up steps: the policy as loaded
    assert any(not torch.equal(after3[k], initial[k]) for k in initial)  # step 3 updates it
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["critic_warmup"] for m in metrics] == [1.0, 1.0, 0.0]
    assert all(m["grad_norm/value"] > 0 for m in metrics) and [m["grad_norm"] for m in metrics][:2] == [0.0, 0.0]
    assert "clip_fraction" not in metrics[0] and "clip_fraction" in metrics[2]
