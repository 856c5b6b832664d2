"""Training with ``params_dtype: bfloat16`` on CPU (one process, offline data): every policy parameter is bf16
(the local spec's RMSNorm weights included, as megatron-LM's Float16Module casts them), the optimizer's main
parameters stay fp32, and 2 steps + checkpoint + resume + 1 step equal 3 steps straight, bit for bit."""

import json
from pathlib import Path

import pytest
import torch
from trainer_helpers import DeterministicSource, make_tiny_hf, train_and_dump_dtypes

from megatron_spo.data.trajectory import Trajectory, write_jsonl
from megatron_spo.models.hf_checkpoint import read_hf_config
from megatron_spo.models.parallel import spawn_local

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]


def _cfg(root: Path, hf: str, model: dict, run: str, steps: int) -> dict:
    return dict(run_dir=str(root / run), steps=steps, beta=0.5,
                init={"hf": hf}, model=model,
                sources={"offline": {"path": str(root / "offline.jsonl"), "objective": "reverse_q",
                                     "loss": "squared"}},
                optimizer={"lr": 2e-3, "warmup_steps": 0},
                batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
                checkpoint={"interval": 100}, logging={"progress": False})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """'straight': 3 steps. 'resumed': 2 steps (final checkpoint), then the same run_dir to 3 steps."""
    root = tmp_path_factory.mktemp("bf16")
    hf = make_tiny_hf(str(root / "hf"))
    src = DeterministicSource(seed=7)
    write_jsonl([Trajectory(prompt_id=t.prompt_id, prompt_tokens=t.prompt_tokens, response_tokens=t.response_tokens,
                            reward=t.reward, source="offline", policy_version=0, q0=-0.4) for t in src.take(48)],
                root / "offline.jsonl")
    model = read_hf_config(hf).model_copy(update={"params_dtype": "bfloat16"}).model_dump()
    spawn_local(train_and_dump_dtypes, 1, [(_cfg(root, hf, model, "straight", 3), str(root / "straight.pt")),
                                            (_cfg(root, hf, model, "resumed", 2), str(root / "resumed-2.pt")),
                                            (_cfg(root, hf, model, "resumed", 3), str(root / "resumed.pt"))])
    return root


def _metrics(run_dir: Path) -> dict[int, dict]:
    return {rec["step"]: rec for rec in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_bf16_policy_parameters_are_all_bf16_and_main_params_fp32(runs):
    out = torch.load(runs / "straight.pt")
    assert len(out["params"]) == 15  # the tiny Llama: embedding, 2 x (2 norms, qkv, proj, fc1, fc2), final norm, head
    assert set(out["params"].values()) == {"torch.bfloat16"}, out["params"]
    assert out["main_params"] and set(out["main_params"]) == {"torch.float32"}
    assert all(w.dtype == torch.bfloat16 for w in out["weights"].values())


def test_bf16_resume_continues_like_the_straight_run(runs):
    assert (runs / "resumed" / "checkpoints" / "iter_0000002" / "COMPLETE").is_file()
    straight, resumed = _metrics(runs / "straight"), _metrics(runs / "resumed")
    assert sorted(resumed) == [1, 2, 3]
    for key in ("loss", "grad_norm"):  # the resumed run's first step (3), bitwise
        assert resumed[3][key] == straight[3][key], key
    assert all(abs(straight[s]["loss"]) < float("inf") for s in straight)
    a, b = torch.load(runs / "straight.pt")["weights"], torch.load(runs / "resumed.pt")["weights"]
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed bf16 parameters differ from the straight run"
    # the steps changed the weights (a resume that loaded nothing would also give equal losses at step 1 only)
    first = torch.load(runs / "resumed-2.pt")["weights"]
    assert any(not torch.equal(first[k], a[k]) for k in a)
