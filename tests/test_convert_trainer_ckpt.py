"""`megatron-spo convert megatron-to-hf` on checkpoints the real trainer writes (policy + value model +
optimizer state + a refreshed reference model, chunk-prefixed keys, two pipeline stages).

One 2-rank spawn trains PPO for 2 steps at PP=2 on a 4-layer tiny Llama; it saves a checkpoint
at the last step, exports RUN_DIR/hf and dumps the final policy weights. The conversions run through
the CLI in subprocesses (megatron's CPU shims never enter the pytest process).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from models_helpers import all_tensors, run_cli  # noqa: E402
from trainer_helpers import VOCAB, run_spawned  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

STEPS = 2


def _tiny_hf(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 64}\n')
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("trainer_ckpt")
    hf = _tiny_hf(root / "init_hf")
    run_dir = root / "run"
    cfg = dict(run_dir=str(run_dir), steps=STEPS, algo="ppo", beta=0.5, init={"hf": str(hf)}, rollout={"temperature_range": [1.0, 1.0], "top_p": 1.0},
               parallel={"pipeline_model_parallel_size": 2},
               optimizer={"lr": 1e-2, "warmup_steps": 0},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 48, "max_seq_length": 64},
               model_update_interval=1, checkpoint={"interval": 100}, logging={"progress": False},
               reference_refresh_interval=1)  # the checkpoint then holds "reference.model0." keys too
    run_spawned([(cfg, str(root / "final_policy.pt"))], world_size=2)
    return {"root": root, "init_hf": hf, "run_dir": run_dir, "final": torch.load(root / "final_policy.pt")}




# Runs `convert` in-process after wrapping both checkpoint read paths (stored chunks viewed in place,
# and torch.distributed.checkpoint's reader) and prints every key read: the optimizer state and the
# value model must never be.
_RECORDING_CONVERT = """
import json, sys
from torch.distributed.checkpoint import FileSystemReader
from megatron_spo.models.megatron_checkpoint import MappedTorchDist
read = []
read_data, get = FileSystemReader.read_data, MappedTorchDist.get
def recording_read_data(self, plan, planner):
    read.extend(item.storage_index.fqn for item in plan.items)
    return read_data(self, plan, planner)
def recording_get(self, key, *args):
    read.append(key)
    return get(self, key, *args)
FileSystemReader.read_data, MappedTorchDist.get = recording_read_data, recording_get
from megatron_spo.models.convert import main
code = main(sys.argv[1:])
print("READ_KEYS " + json.dumps(sorted(set(read))))
sys.exit(code)
"""


def test_step_dir_converts_to_the_trainers_final_policy(run, tmp_path):
    step_dir = run["run_dir"] / "checkpoints" / f"iter_{STEPS:07d}"
    assert (step_dir / "COMPLETE").is_file()
    out = tmp_path / "hf"
    proc = run_cli("megatron-to-hf", "--megatron", str(step_dir), "--out", str(out), code=_RECORDING_CONVERT)
    keys = json.loads(proc.stdout.split("READ_KEYS ", 1)[1])
    assert keys and all(k.startswith("policy.model0.") for k in keys), keys
    from torch.distributed.checkpoint import FileSystemReader

    stored = FileSystemReader(str(step_dir / "dist")).read_metadata().state_dict_metadata
    assert any(k.startswith("reference.model0.") for k in stored)  # there, and never read
    assert any(".layers." in k for k in keys) and any("output_layer" in k for k in keys)

    # the converted weights are the trainer's final policy, bit for bit
    converted, final = all_tensors(out), run["final"]
    assert converted.keys() == final.keys()
    assert all(torch.equal(converted[k], final[k]) for k in final)
    assert not torch.equal(converted["lm_head.weight"], load_file(run["init_hf"] / "model.safetensors")[
        "lm_head.weight"]), "training did not move the policy: the test would prove nothing"

    # transformers gives the same logits as for the trainer's own export RUN_DIR/hf
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()(ids).logits
        export = AutoModelForCausalLM.from_pretrained(run["run_dir"] / "hf", dtype=torch.float32).eval()(ids).logits
    assert (ours - export).abs().max().item() <= 1e-6
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # the init config's fields ride along
    assert (out / "tokenizer_config.json").read_text() == (run["init_hf"] / "tokenizer_config.json").read_text()


def test_check_conversion_reads_the_trainer_checkpoint(run):
    step_dir = run["run_dir"] / "checkpoints" / f"iter_{STEPS:07d}"  # written under PP=2
    proc = run_cli("check-conversion", "--hf", str(run["run_dir"] / "hf"), "--megatron", str(step_dir), "--json",
                   "--no-progress")
    report = json.loads(proc.stdout)
    assert report["ok"], report["summary"]
    assert all(f["error"] == 0.0 for f in report["findings"] if f["what"] == "tensor")
    assert len([f for f in report["findings"] if f["what"] == "layer"]) == 4
    # the run's initial HF model is not this step's: the first trained tensor is named
    proc = run_cli("check-conversion", "--hf", str(run["init_hf"]), "--megatron", str(step_dir), "--no-progress",
                   check=False)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines()[-1].startswith(
        "FAIL: first disagreement: tensor model.embed_tokens.weight[0:61] differs (error ")


def test_run_dir_picks_the_latest_complete_step(run, tmp_path):
    # an incomplete newer step (a crash mid-save) must be ignored
    partial = run["run_dir"] / "checkpoints" / f"iter_{STEPS + 5:07d}"
    (partial / "dist").mkdir(parents=True)
    try:
        out = tmp_path / "hf"
        run_cli("convert", "megatron-to-hf", "--megatron", str(run["run_dir"]), "--out", str(out))
    finally:
        partial.joinpath("dist").rmdir()
        partial.rmdir()
    converted = all_tensors(out)
    assert all(torch.equal(converted[k], run["final"][k]) for k in run["final"])


def test_neither_checkpoint_nor_run_dir_is_one_clear_error(tmp_path):
    (tmp_path / "junk").mkdir()
    proc = run_cli("convert", "megatron-to-hf", "--megatron", str(tmp_path / "junk"), "--out", str(tmp_path / "o"),
                check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"megatron-spo convert: error: {tmp_path / 'junk'}: not a "
                                                   "Megatron checkpoint"), proc.stderr
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.tmp").exists()
