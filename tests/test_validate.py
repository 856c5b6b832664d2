"""`megatron-spo validate` / `train --dry-run`: a good tiny config passes with a summary; a config with several
planted mistakes lists each one, by field, on its own line, before anything is spawned; `plan --config` plans
the training config's own batch and sequence length."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from rollout_helpers import make_tiny_llama  # noqa: E402
from test_user_data import write_q0  # noqa: E402

from megatron_spo.validate import main as validate_main  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _good_config(tmp_path: Path) -> dict:
    """A tiny SPO run: tiny HF Llama with a tokenizer (4 heads, 2 KV heads, 256 positions), toy prompts with their Q0, an offline
    file of 3 records (one without q0, filled from the q0 file)."""
    from megatron_spo.data.problems import problems_from_task_config
    from megatron_spo.training.config import TrainConfig

    hf = make_tiny_llama(str(tmp_path / "hf"))
    task = {"kind": "toy", "limit": 4, "max_prompt_tokens": 40}
    ids = [p.id for p in problems_from_task_config(TrainConfig.model_validate(dict(init={"hf": hf}, task=task)).task)]
    task["q0_path"] = write_q0(tmp_path / "q0.jsonl", {i: (1, 2) for i in ids})
    offline = tmp_path / "offline.jsonl"
    offline.write_text("".join(json.dumps({"prompt_id": ids[i], "prompt_tokens": [1, 2], "response_tokens": [3],
                                           "reward": 0.0, "source": "offline", "policy_version": 0,
                                           **({"q0": -0.5} if i else {})}) + "\n" for i in range(3)))
    return dict(run_dir=str(tmp_path / "run"), steps=2, beta=0.5, init={"hf": hf}, nproc=2,
                batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 128, "max_seq_length": 64},
                sources={"online": {"weight": 0.5}, "offline": {"weight": 0.5, "path": str(offline)}},
                task=task, rollout={"max_new_tokens": 16})


def _report(text: str) -> list[str]:
    """The validate report's lines of stderr (model writers print progress bars there too)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("megatron-spo validate: "))
    return [lines[start]] + [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


def _write(tmp_path: Path, cfg: dict) -> str:
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_a_good_config_passes_with_a_summary(tmp_path, capsys):
    path = _write(tmp_path, _good_config(tmp_path))
    assert validate_main([path]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"megatron-spo validate: {path} OK: llama 22.6K parameters; ")
    for part in ("layout TP 1 x PP 1 x DP 2 on 2 rank(s)", "sources.offline: 3 records", "task: 4 toy problems",
                 "GB per GPU of 80 (batch 8 x seq 64, micro-batch 2 x 64 tokens)"):
        assert part in out
    from megatron_spo.cli import main as cli_main

    assert cli_main(["train", path, "--dry-run", "steps=3"]) == 0  # the same checks; nothing spawned
    assert "megatron-spo train --dry-run: " in capsys.readouterr().out


def test_every_planted_mistake_is_listed_by_field(tmp_path, capsys):
    cfg = _good_config(tmp_path)
    cfg["sources"]["old"] = {"weight": 0.1, "path": str(tmp_path / "no-such-store")}
    cfg["sources"]["picked"] = {"weight": 0.1, "path": cfg["sources"]["offline"]["path"],
                                "select": {"kinds": ["pts"]}}  # its records have no provenance: none match
    cfg["task"]["reward"] = "examples.nope:score"
    cfg["parallel"] = {"tensor_model_parallel_size": 3}
    cfg["fleet"] = {"engine_tp_size": 3}
    cfg["batch"]["max_seq_length"] = 512
    cfg["task"]["q0_path"] = str(tmp_path / "missing-q0.jsonl")
    path = _write(tmp_path, cfg)
    assert validate_main([path, "--world-size", "6"]) == 1
    err = _report(capsys.readouterr().err)
    assert err[0] == f"megatron-spo validate: 7 problem(s) in {path}:"
    offline = cfg["sources"]["offline"]["path"]
    assert err[1:] == [
        f"sources.old.path: path '{tmp_path / 'no-such-store'}' does not exist",
        f"task.q0_path: q0 file '{tmp_path / 'missing-q0.jsonl'}' does not exist",
        "task.reward: cannot import 'examples.nope' (ModuleNotFoundError: No module named 'examples.nope')",
        "parallel.tensor_model_parallel_size 3 does not divide model.num_attention_heads 4",
        "fleet.engine_tp_size: 3 does not divide model.num_attention_heads 4 / num_query_groups 2 (engines shard "
        "heads over TP)",
        "batch.max_seq_length: 512 > the model's max_position_embeddings 256",
        f"sources.picked.select: none of the 3 records of {offline} match {{'kinds': ['pts']}}",
    ]


def test_memory_over_the_gpu_and_a_config_that_does_not_parse(tmp_path, capsys):
    path = _write(tmp_path, _good_config(tmp_path))
    assert validate_main([path, "--gpu-memory-gb", "2"]) == 1
    [head, line] = _report(capsys.readouterr().err)
    assert line.startswith("memory: the plan needs 4.0 GB per GPU (batch 8 x seq 64, micro-batch 2 x 64 "
                                   "tokens) > 2 GB")
    assert validate_main([path, "batch.max_seq_length=40"]) == 1  # the toy prompts are 13-27 tokens
    assert _report(capsys.readouterr().err)[1:] == [
        "batch.max_seq_length: 40 < the longest prompt (27 tokens) + rollout.max_new_tokens 16"]
    assert validate_main([path, "steps=0", "algo=trpo"]) == 1  # field errors: one line each
    err = _report(capsys.readouterr().err)
    assert err[0].endswith("2 problem(s) in " + path + ":") and "steps" in err[1] and "algo" in err[2]


def test_plan_uses_the_training_configs_batch_and_sequence_length(tmp_path, capsys):
    from megatron_spo.planning.capacity import main as plan_main

    assert plan_main(["--preset", "llama3.1-8b", "--config", str(REPO / "examples/llama3.1-8b-spo.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    shape = plan["shape"]
    # the config's 128 x 8192 (16384 tokens per micro-batch: 2 sequences), half online; was 256 x 4096, online 1.0
    assert (shape["global_batch_size"], shape["seq_length"], shape["micro_batch_size"]) == (128, 8192, 2)
    assert (shape["online_fraction"], shape["response_tokens"], shape["model_update_interval"]) == (0.5, 2048, 10)
    assert plan["memory_gb"]["dist-opt, no recompute"]["total"] == pytest.approx(75.65, abs=0.01)  # 64 MiB blocks
    assert plan["config_scenario"] == "dist-opt, no recompute"  # the config's own column (validate's figure)
    plan_only = tmp_path / "plan.yaml"
    plan_only.write_text("plan: {global_batch_size: 256, seq_length: 4096}\n")
    assert plan_main(["--preset", "llama3.1-8b", "--config", str(plan_only), "--json"]) == 0
    shape = json.loads(capsys.readouterr().out)["shape"]  # a plan-only YAML: its own plan section
    assert (shape["global_batch_size"], shape["seq_length"]) == (256, 4096)



EXAMPLES = sorted((REPO / "examples").glob("*-spo*.yaml"))
# what an example leaves to the flow's stages (the offline build, Q0, PTS) and to its user (task.paths)
PLACEHOLDERS = ("sources.offline.path:", "sources.mc.path:", "task.paths:", "task.q0_path:")


@pytest.fixture(scope="module")
def config_only_hf(tmp_path_factory):
    """hf_dir(config dict): an HF directory with the config's model as config.json and a tiny tokenizer, no
    weights (validate reads the architecture and the tokenizer only)."""
    from megatron_spo.models.config import ModelConfig
    from megatron_spo.models.hf_checkpoint import write_hf_config

    root = tmp_path_factory.mktemp("config-only")

    def hf_dir(data: dict) -> str:
        path = root / f"hf-{len(list(root.iterdir()))}"
        make_tiny_llama(str(path))
        for weights in path.glob("*.safetensors"):
            weights.unlink()
        write_hf_config(path, ModelConfig.model_validate(data["model"]))
        return str(path)

    return hf_dir


def _validate_at_64(path: Path, overrides: list[str] = ()):
    from megatron_spo.validate import validate_file

    return validate_file(str(path), list(overrides), world_size=64, gpu_memory_gb=80.0)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_the_example_configs_validate_on_64_gpus(example, config_only_hf):
    """Every examples/*-spo*.yaml at 64 trainer GPUs of 80 GB, init.hf a config-only directory of its model: the
    only problems are the data the flow writes and the user fills in; the layout and the memory plan pass."""
    hf = config_only_hf(yaml.safe_load(example.read_text()))
    report = _validate_at_64(example, ["init.megatron=null", f"init.hf={hf}"])
    assert report.problems and all(p.startswith(PLACEHOLDERS) for p in report.problems), report.problems
    assert any(n.startswith("memory plan ") for n in report.notes), report.notes
    if example.stem == "qwen3-30b-a3b-spo":  # the plan preset's EP 8 layout, which the trainer trains now
        assert "layout TP 1 x PP 1 x DP 64 on 64 rank(s)" in report.notes
        assert any(n.startswith("memory plan 78.9 GB per GPU of 80") for n in report.notes), report.notes
    if example.stem == "llama3.1-70b-spo-32k":  # what its comments quote
        assert "layout TP 8 x PP 2 x DP 4 on 64 rank(s)" in report.notes
        assert ("memory plan 62.6 GB per GPU of 80 (batch 128 x seq 34816, micro-batch 1 x 34816 tokens, full "
                "recompute)") in report.notes


def test_validate_and_plan_give_one_figure_for_the_70b_example_at_32k(tmp_path, config_only_hf, capsys):
    """The 70B example at 32k tokens with full recompute: validate prices the config's recompute with plan's very
    function (capacity.config_memory), so both say 62.0 GB and it validates; it used to refuse the layout at the
    no-recompute figure (156.0 GB now: the log-prob block of 64 MiB; 156.7 GB with the old 512 MiB default)."""
    from megatron_spo.config import load_config
    from megatron_spo.planning import capacity
    from megatron_spo.planning.capacity import main as plan_main
    from megatron_spo.planning.config import CapacityConfig
    from megatron_spo.training.config import TrainConfig

    data = yaml.safe_load((REPO / "examples/llama3.1-70b-spo.yaml").read_text())
    data["batch"].update(max_seq_length=32768, max_tokens_per_micro_batch=32768)
    data["parallel"].update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    data["init"] = {"hf": config_only_hf(data), "megatron": None}
    path = tmp_path / "70b-32k.yaml"
    path.write_text(yaml.safe_dump(data))

    assert plan_main(["--config", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["config_scenario"] == "dist-opt, full recompute"
    figure = plan["memory_gb"]["dist-opt, full recompute"]
    cfg = load_config(TrainConfig, str(path), [])
    shape = CapacityConfig(**capacity.capacity_shape(cfg, 64, 80.0))
    assert figure["total"] == capacity.config_memory(cfg.model, shape, cfg.parallel).total / 1e9  # the same number
    h, f, kv, t = 8192, 28672, 1024, 32768
    per_layer = (6 * h + 2 * kv + 3 * f) / 8 * t * 2
    assert figure["activations"] == pytest.approx((90 * h / 8 * t * 2 + 2 * per_layer) / 1e9)
    assert (round(figure["total"], 1), round(plan["memory_gb"]["dist-opt, no recompute"]["total"], 1)) == (62.0, 156.0)

    report = _validate_at_64(path)
    assert all(p.startswith(PLACEHOLDERS) for p in report.problems), report.problems  # no memory problem
    assert (f"memory plan {figure['total']:.1f} GB per GPU of 80 (batch 128 x seq 32768, micro-batch 1 x 32768 "
            "tokens, full recompute)") in report.notes
