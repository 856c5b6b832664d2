"""Megatron Llama models, the HF<->Megatron map and checkpoint conversion (tiny random Llama, fp32, CPU).

One 4-process gloo spawn runs every layout (TP=1, TP=2, PP=2, TP=2 x PP=2, PP=2 x VPP=2) and records
numbers; the tests assert them. The CLI runs in subprocesses so megatron's CPU shims never enter the
pytest process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import models_helpers as mh  # noqa: E402
from selection import is_selected, selected_params  # noqa: E402

from megatron_spo.config import ConfigError  # noqa: E402
from megatron_spo.models import hf_checkpoint as hfc  # noqa: E402
from megatron_spo.models.config import ModelConfig, ParallelConfig  # noqa: E402

pytestmark = pytest.mark.megatron

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return mh.make_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny")


@pytest.fixture(scope="module")
def parallel_results(request, hf_dir, tmp_path_factory) -> dict:
    """Each selected layout's parity with transformers by name; the TP=2 x PP=2 checkpoint and what reads it when a
    test of it is selected."""
    from megatron_spo.models.parallel import spawn_local

    wanted = selected_params(request, "test_layout_matches_transformers", "layout") | selected_params(
        request, "test_hidden_states_with_fused_logprobs_give_transformers_gradients", "layout")
    if is_selected(request, "test_padded_vocab_columns_are_masked"):
        wanted |= {"tp1_pp1", "tp2_pp1"}
    after = is_selected(request, *READ_THE_TP2_PP2_CHECKPOINT)
    if after:
        wanted.add("tp2_pp2")
    work = tmp_path_factory.mktemp("parallel")
    spawn_local(mh.parallel_worker, 4, str(hf_dir), str(work / "results.json"), str(work / "ckpt"), sorted(wanted),
                after)
    return {**json.loads((work / "results.json").read_text()), "ckpt_tp2pp2_dir": str(work / "ckpt")}


# ---------------------------------------------------------------------------------------------
# Multi-process: parity, gradients, export, checkpoint resharding
# ---------------------------------------------------------------------------------------------
LAYOUT_NAMES = [mh.layout_name(*layout) for layout in mh.LAYOUTS]
READ_THE_TP2_PP2_CHECKPOINT = (
    "test_tp2_pp2_checkpoint_loads_at_tp1", "test_tp2_pp2_checkpoint_converts_to_hf_bit_exactly",
    "test_reference_and_value_models", "test_ddp_and_distributed_optimizer_step_on_cpu",
    "test_check_conversion_of_the_tp2_pp2_checkpoint")


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_layout_matches_transformers(parallel_results, layout):
    r = parallel_results[layout]
    assert r["logit_max_abs_diff"] < 1e-4, r
    # final hidden states @ LM-head shard reproduces the model's (masked) logits exactly
    assert r["hidden_matmul_vs_logits"] < 1e-5, r
    # gradients of a next-token loss match a single-process transformers backward
    assert r["grad_max_rel_diff"] < 1e-4, r
    # the streaming HF export gathers every tensor bit-exactly (4 layers x 9 + embed, norm, lm_head)
    assert r["export_bit_exact"] is True
    assert r["export_count"] == 4 * 9 + 3


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_hidden_states_with_fused_logprobs_give_transformers_gradients(parallel_results, layout):
    """The trainer's path: gpt hidden states + lm_head_weight shard -> ops.token_logprobs (vocab-parallel)."""
    r = parallel_results[layout]
    assert r["grad_via_hidden_max_rel_diff"] < 1e-4, r


@pytest.mark.multiproc
def test_padded_vocab_columns_are_masked(parallel_results):
    # vocab 1001 padded to 1024: the last TP rank's shard (or the only shard) holds 23 padded columns
    tp1 = parallel_results["tp1_pp1"]["last_stage_info"]
    tp2 = parallel_results["tp2_pp1"]["last_stage_info"]
    assert {d["padded_cols_on_last_rank"] for d in tp1} == {23}
    assert sorted(d["padded_cols_on_last_rank"] for d in tp2) == [0, 0, 23, 23]  # DP=2 x TP=2
    assert all(d["hidden_shape"] == [2, mh.SEQ, 64] for d in tp1 + tp2)


@pytest.mark.multiproc
def test_tp2_pp2_checkpoint_loads_at_tp1(parallel_results):
    assert parallel_results["ckpt_tp2pp2_to_tp1"]["logit_max_abs_diff"] < 1e-4


@pytest.mark.multiproc
def test_tp2_pp2_checkpoint_converts_to_hf_bit_exactly(parallel_results, hf_dir, tmp_path):
    # stored TP shards are not the TP=1 slices conversion asks for: the resharding read path
    out = tmp_path / "hf"
    mh.run_cli("convert", "megatron-to-hf", "--megatron", parallel_results["ckpt_tp2pp2_dir"], "--out", str(out))
    src, dst = mh.all_tensors(hf_dir), mh.all_tensors(out)
    assert src.keys() == dst.keys() and all(torch.equal(src[k], dst[k]) for k in src)


@pytest.mark.multiproc
def test_reference_and_value_models(parallel_results):
    ref = parallel_results["reference"]
    assert ref == {"any_requires_grad": False, "training": False, "logits_equal_policy": True}
    value = parallel_results["value"]
    assert value["shape"] == [4, mh.SEQ]
    assert value["max_abs_diff_vs_hidden_dot_head"] < 1e-5
    # PPO's value model from init.megatron (a TP2 x PP2 LM checkpoint): same trunk, its own zero head
    assert value["from_megatron_head_was_zero"] is True
    assert value["from_megatron_max_abs_diff"] < 1e-5
    assert value["from_megatron_without_keep_own"].endswith(
        "ckpt: checkpoint does not fit the model: it has no tensor 'value_head.bias' (and 1 more)"
    )


@pytest.mark.multiproc
def test_ddp_and_distributed_optimizer_step_on_cpu(parallel_results):
    """The CPU shims carry megatron DDP + the distributed optimizer (DP=4, gloo) through one Adam step."""
    r = parallel_results["ddp_distributed_optimizer"]
    assert r["stepped"] is True
    assert r["grad_norm"] == pytest.approx(r["hf_grad_norm"], rel=1e-5)
    # Adam's first step moves every parameter by ~lr (1e-3) regardless of the gradient's scale
    assert r["param_moved"] == pytest.approx(1e-3, rel=0.05)


def test_rope_scaling_changes_logits_at_test_length(hf_dir):
    """The 1e-4 parity tests would catch missing rope scaling, or megatron's hard-coded llama3
    parameters (original_max_position_embeddings 8192) instead of the config's (32)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = mh.tokens()
    with torch.no_grad():
        scaled = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(ids).logits
        for rope in (
            {"rope_type": "default", "rope_theta": 500000.0},
            {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ):
            other_cfg = LlamaConfig.from_pretrained(hf_dir)
            other_cfg.rope_parameters = rope
            other = LlamaForCausalLM.from_pretrained(hf_dir, config=other_cfg, dtype=torch.float32).eval()
            assert (scaled - other(ids).logits).abs().max().item() > 1e-3, rope


# ---------------------------------------------------------------------------------------------
# CLI conversion (subprocesses)
# ---------------------------------------------------------------------------------------------


@pytest.mark.multiproc
@pytest.mark.slow
def test_hf_megatron_hf_round_trip_and_check(hf_dir, tmp_path):
    meg, back = tmp_path / "meg", tmp_path / "back"
    mh.run_cli("convert", "hf-to-megatron", "--hf", str(hf_dir), "--out", str(meg))
    assert (meg / "metadata.json").is_file() and not (tmp_path / "meg.tmp").exists()
    mh.run_cli("convert", "megatron-to-hf", "--megatron", str(meg), "--out", str(back))

    src, dst = mh.all_tensors(hf_dir), mh.all_tensors(back)
    assert src.keys() == dst.keys()
    assert all(torch.equal(src[k], dst[k]) for k in src), "round trip is not bit-exact"
    assert hfc.read_hf_config(back) == hfc.read_hf_config(hf_dir)
    assert (back / "tokenizer_config.json").read_text() == (hf_dir / "tokenizer_config.json").read_text()
    assert (back / "generation_config.json").is_file()
    index = json.loads((back / hfc.INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(src)

    # megatron-to-hf viewed this TP=1 checkpoint's stored chunks in place (the fast path), padding and all
    from megatron_spo.models.megatron_checkpoint import MappedTorchDist

    stored = MappedTorchDist(meg)
    embed = stored.get("embedding.word_embeddings.weight", (0, 0), (1024, 64), torch.float32)
    assert embed is not None
    assert torch.equal(embed[:1001], src["model.embed_tokens.weight"]) and not embed[1001:].any()
    assert stored.get("embedding.word_embeddings.weight", (0, 0), (512, 64), torch.float32) is None

    # the output loads in transformers unchanged and gives identical logits
    from transformers import AutoModelForCausalLM

    ids = mh.tokens(batch=2)
    a = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)

    # the streaming check-conversion passes, every layer exactly: megatron's layer with the SDPA core attention runs
    # the kernels transformers' sdpa attention runs (a failing layer's line: test_a_disagreeing_layer_is_named)
    ok = mh.run_cli("check-conversion", "--hf", str(hf_dir), "--megatron", str(meg), "--no-progress")
    line = ok.stdout.strip().splitlines()[-1]
    assert line.startswith("OK: 39 tensors identical; 4 layers, worst isolated rel err 0.0e+00, carried 0.0e+00"), line


def test_a_disagreeing_layer_is_named():
    from megatron_spo.models.check_conversion import CheckReport, Finding

    report = CheckReport([Finding("tensor", "model.layers.0.mlp.up_proj.weight", 0.0, 0.0),
                          Finding("layer", "model.layers.0", 2.5e-3, 1e-4),
                          Finding("layer", "model.layers.1", 0.0, 1e-4)])
    assert not report.ok
    assert report.summary() == "FAIL: first disagreement: layer model.layers.0 disagrees (error 2.500e-03 > tol 0.0001)"


def test_check_conversion_of_the_tp2_pp2_checkpoint(parallel_results, hf_dir):
    proc = mh.run_cli("check-conversion", "--hf", str(hf_dir), "--megatron", parallel_results["ckpt_tp2pp2_dir"],
                      "--json", "--no-progress")
    report = json.loads(proc.stdout)
    assert report["ok"] and all(f["error"] == 0.0 for f in report["findings"] if f["what"] == "tensor")


# ---------------------------------------------------------------------------------------------
# Bad input: one-line errors naming the tensor or field; nothing half-written
# ---------------------------------------------------------------------------------------------
def _copy_hf(hf_dir: Path, dst: Path) -> Path:
    dst.mkdir()
    tensors = mh.all_tensors(hf_dir)
    save_file(tensors, dst / "model.safetensors")
    (dst / "config.json").write_text((hf_dir / "config.json").read_text())
    return dst


def _convert_error(hf: Path, out: Path) -> str:
    from megatron_spo.models.convert import hf_to_megatron

    with pytest.raises((hfc.HFCheckpointError, ConfigError)) as info:
        hf_to_megatron(hf, out)
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_unsupported_architecture(hf_dir, tmp_path):
    bad = _copy_hf(hf_dir, tmp_path / "hf")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = _convert_error(bad, tmp_path / "out")
    assert msg == (
        f"{bad}/config.json: unsupported architecture ['DeepseekV3ForCausalLM'] (field 'architectures'; "
        "supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM)"
    )


def test_unsupported_config_field(hf_dir, tmp_path):
    bad = _copy_hf(hf_dir, tmp_path / "hf")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (bad / "config.json").write_text(json.dumps(cfg))
    assert _convert_error(bad, tmp_path / "out") == (
        f"{bad}/config.json: unsupported hidden_act='gelu' (supported: 'silu')"
    )


def test_config_not_matching_tensors(hf_dir, tmp_path):
    bad = _copy_hf(hf_dir, tmp_path / "hf")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 128
    (bad / "config.json").write_text(json.dumps(cfg))
    assert _convert_error(bad, tmp_path / "out") == (
        f"{bad}: tensor 'model.layers.0.mlp.gate_proj.weight' has shape [96, 64] but config.json implies [128, 64]"
    )


def test_missing_and_extra_tensor(hf_dir, tmp_path):
    tensors = mh.all_tensors(hf_dir)
    missing = _copy_hf(hf_dir, tmp_path / "missing")
    save_file(
        {k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.v_proj.weight"},
        missing / "model.safetensors",
    )
    assert _convert_error(missing, tmp_path / "out1") == (
        f"{missing}: missing tensor 'model.layers.2.self_attn.v_proj.weight' (config.json expects shape [32, 64])"
    )
    extra = _copy_hf(hf_dir, tmp_path / "extra")
    save_file(
        {**tensors, "model.layers.9.mlp.gate_proj.weight": torch.zeros(2, 2)}, extra / "model.safetensors"
    )
    assert _convert_error(extra, tmp_path / "out2") == (
        f"{extra}: unexpected tensor 'model.layers.9.mlp.gate_proj.weight' not in a LlamaForCausalLM with this config.json"
    )


def test_index_pointing_to_missing_shard(hf_dir, tmp_path):
    bad = tmp_path / "hf"
    bad.mkdir()
    dropped = sorted(hf_dir.glob("*.safetensors"))[2].name
    for f in hf_dir.iterdir():
        if f.name != dropped:
            (bad / f.name).write_bytes(f.read_bytes())
    msg = _convert_error(bad, tmp_path / "out")
    assert msg.startswith(f"{bad}: tensor '") and msg.endswith(
        f"indexed in '{dropped}', which does not exist"
    ), msg


def test_existing_output_is_refused(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    from megatron_spo.models.convert import hf_to_megatron

    with pytest.raises(ConfigError, match=f"^output directory '{out}' already exists"):
        hf_to_megatron(hf_dir, out)


def test_failed_write_leaves_nothing(tmp_path):
    from megatron_spo.models.convert import _atomic_dir

    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with _atomic_dir(out) as tmp:
            (tmp / "metadata.json").write_text("{}")
            raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# Streaming tensor I/O
# ---------------------------------------------------------------------------------------------
def test_mapped_view_equals_the_copy_and_never_writes_the_file(hf_dir):
    reader = hfc.HFReader(hf_dir)
    name = "model.layers.1.mlp.down_proj.weight"
    view, copy = reader.view(name), reader.get(name)
    assert torch.equal(view, copy) and view.shape == copy.shape
    file = hf_dir / reader.weight_map[name]
    before = file.read_bytes()
    view.add_(1.0)  # a private copy-on-write map: the checkpoint on disk stays as it was
    assert file.read_bytes() == before and torch.equal(reader.get(name), copy)


def test_stream_writer_plans_shards_and_writes_strided_views(tmp_path):
    a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)[:, 1:]  # strided: rows 1-2 of each block
    c = torch.ones(5)
    shapes = {"a": (3, 4), "b": (4, 4), "c": (5,)}
    with hfc.HFStreamWriter(tmp_path / "out", shapes, torch.float32, max_shard_bytes=64) as writer:
        writer.add("a", a)
        writer.add("b", b)  # any shape with the planned number of elements: row-major order is written
        writer.add("c", c)
    index = json.loads((tmp_path / "out" / hfc.INDEX_NAME).read_text())
    assert index["weight_map"] == {"a": "model-00001-of-00003.safetensors", "b": "model-00002-of-00003.safetensors",
                                   "c": "model-00003-of-00003.safetensors"}
    assert index["metadata"]["total_size"] == (12 + 16 + 5) * 4
    loaded = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        loaded.update(load_file(f))
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"], b.reshape(4, 4)) and torch.equal(loaded["c"], c)
    assert not list((tmp_path / "out").glob("*.tmp"))

    with pytest.raises(hfc.HFCheckpointError, match="got tensor 'b', expected 'a'"):
        with hfc.HFStreamWriter(tmp_path / "o2", shapes, torch.float32) as writer:
            writer.add("b", b)
    with pytest.raises(hfc.HFCheckpointError, match=r"tensor 'a' is \[3, 3\] torch.float32, planned \[3, 4\]"):
        with hfc.HFStreamWriter(tmp_path / "o3", shapes, torch.float32) as writer:
            writer.add("a", a[:, :3])
    with pytest.raises(hfc.HFCheckpointError, match=r"closed after 1 of 3 tensors \(next: 'b'\)"):
        with hfc.HFStreamWriter(tmp_path / "o4", shapes, torch.float32) as writer:
            writer.add("a", a)


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ---------------------------------------------------------------------------------------------
def test_hf_config_round_trip_and_both_rope_styles(hf_dir):
    cfg = hfc.read_hf_config(hf_dir)  # transformers 5 writes rope_parameters
    assert cfg.rope_scaling is not None and cfg.rope_scaling.original_max_position_embeddings == 32
    assert (cfg.num_query_groups, cfg.vocab_size, cfg.norm_epsilon) == (2, mh.VOCAB, 1e-5)
    classic = hfc.model_config_to_hf_config(cfg)  # rope_theta + rope_scaling, as Llama 3.1 on the hub
    assert "rope_parameters" not in classic and classic["rope_scaling"]["rope_type"] == "llama3"
    assert hfc.hf_config_to_model_config(classic) == cfg


# ---------------------------------------------------------------------------------------------
# Refused parallel layouts (before any process group is built)
# ---------------------------------------------------------------------------------------------
TINY = ModelConfig(
    num_layers=4,
    hidden_size=64,
    ffn_hidden_size=96,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=1001,
)


@pytest.mark.parametrize(
    "parallel, world, message",
    [
        (
            dict(tensor_model_parallel_size=4),
            4,
            "parallel.tensor_model_parallel_size 4 does not divide model.num_query_groups 2",
        ),
        (
            dict(tensor_model_parallel_size=3),
            3,
            "parallel.tensor_model_parallel_size 3 does not divide model.num_attention_heads 4",
        ),
        (
            dict(pipeline_model_parallel_size=3),
            3,
            "parallel: pipeline_model_parallel_size 3 x virtual_pipeline_model_parallel_size 1 = 3 does not divide "
            "model.num_layers 4",
        ),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=4),
            2,
            "parallel: pipeline_model_parallel_size 2 x virtual_pipeline_model_parallel_size 4 = 8 does not divide "
            "model.num_layers 4",
        ),
        (
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            6,
            "parallel: world size 6 is not divisible by tensor_model_parallel_size 2 x pipeline_model_parallel_size "
            "2 = 4",
        ),
        (
            dict(sequence_parallel=True),
            2,
            "parallel.sequence_parallel needs tensor_model_parallel_size > 1 (it splits the sequence over the TP ranks)",
        ),
        (
            dict(context_parallel_size=2, attention_kernel="dot_product"),
            2,
            "parallel.context_parallel_size 2: megatron-core's DotProductAttention (parallel.attention_kernel "
            "dot_product) refuses context parallelism; use attention_kernel sdpa",
        ),
        (
            dict(tensor_model_parallel_size=2, context_parallel_size=2),
            6,
            "parallel: world size 6 is not divisible by tensor_model_parallel_size 2 x pipeline_model_parallel_size "
            "1 x context_parallel_size 2 = 4",
        ),
    ],
)
def test_refused_layouts(monkeypatch, parallel, world, message):
    import torch.distributed as dist

    from megatron_spo.models.parallel import init_parallel

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError) as info:
        init_parallel(ParallelConfig(**parallel), TINY)
    assert str(info.value) == message
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "preset, params, dp, padded_vocab",
    [("llama3.1-8b", 8_030_261_248, 32, 128256), ("llama3.1-70b", 70_553_706_496, 4, 129024)],
)
def test_presets_are_valid_64_gpu_layouts(preset, params, dp, padded_vocab):
    from megatron_spo.config import StrictModel, load_config

    class Preset(StrictModel):
        model: ModelConfig
        parallel: ParallelConfig

    cfg = load_config(Preset, REPO / "examples" / "models" / f"{preset}.yaml")
    cfg.parallel.check(cfg.model, world_size=64)
    assert cfg.model.num_parameters() == params  # the published Llama 3.1 parameter count
    assert cfg.parallel.data_parallel_size(64) == dp
    assert cfg.model.padded_vocab_size(cfg.parallel.tensor_model_parallel_size) == padded_vocab
