"""tools/bench_step.py (the GPU kit's training benchmark) runs here at its tiny size: the real Trainer's SPO step
and megatron-core's LM step on the same micro-batches, with the numbers a GPU run reports."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench_step  # noqa: E402


@pytest.mark.slow
def test_the_step_benchmark_reports_both_steps_at_its_tiny_size(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_step.py"), "--device", "cpu", "--size", "tiny",
                           "--steps", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "step_bench.json").read_text())
    assert [(c["seq"], c["sequences"], c["micro_batches"]) for c in report["cases"]] == [(96, 8, 2), (384, 1, 1)]
    for case in report["cases"]:
        assert case["spo_tokens_per_s"] > 0 and case["lm_tokens_per_s"] > 0
        # megatron's own LM loss of random tokens under a near-uniform random model: about log(vocab)
        assert case["lm_loss"] == pytest.approx(math.log(1000), abs=0.2), case["lm_loss"]
        # whole prompt groups in each micro-batch: no no-grad policy pass for the centred baselines
        assert set(case["spo_split_s"]) == {"reference forward", "policy forward + backward + optimizer"}
    assert "| 8 x 96 | 768 |" in (tmp_path / "step_bench.md").read_text()


def test_the_flop_count_is_the_stated_formula():
    from megatron_spo.models.config import ModelConfig

    cfg = ModelConfig(**bench_step.SHAPES["full"])
    per_token = bench_step.model_flops_per_token(cfg, 4096)
    # Llama-3.2-1B: 1.236 B parameters, its tied 262.7 M embedding counted once, as the LM head's GEMM
    assert cfg.num_parameters() == 1_235_814_400
    attention = 6 * 16 * 4096 * 32 * 64
    assert per_token == 6 * 1_235_814_400 + attention
