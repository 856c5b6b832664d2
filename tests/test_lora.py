"""LoRA on the policy (models/lora.py, issue 46): config, the tensor-parallel adapter layers, pi_0 with the adapters
off, training parity across layouts, checkpoints."""

import pytest
import torch
from lora_helpers import layer_math_worker, random_adapters
from trainer_helpers import make_tiny_hf

from megatron_spo.config import ConfigError, build_config
from megatron_spo.models.lora import TARGETS, LoraConfig
from megatron_spo.training.config import TrainConfig


def test_lora_config_fields_and_scaling():
    assert LoraConfig().targets == list(TARGETS)
    assert LoraConfig(rank=4, alpha=8).scaling == 2.0
    assert LoraConfig(rank=4, alpha=8, rslora=True).scaling == 4.0
    with pytest.raises(ConfigError) as err:
        build_config(LoraConfig, {"targets": ["linear_qkv", "q_proj"]})
    assert str(err.value) == ("targets: unknown target 'q_proj' (choose from linear_qkv, linear_proj, linear_fc1, "
                              "linear_fc2) (got ['linear_qkv', 'q_proj'])")
    for bad, field in (({"rank": 0}, "rank"), ({"dropout": 1.0}, "dropout"), ({"targets": []}, "targets"),
                       ({"bias": True}, "bias")):
        with pytest.raises(ConfigError, match=rf"^{field}: "):
            build_config(LoraConfig, bad)


def _train_cfg(**kw):
    return dict(init={"hf": "/nonexistent"}, **kw)


def test_an_unknown_target_in_a_training_config_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as err:
        build_config(TrainConfig, _train_cfg(lora={"targets": ["linear_qkv", "q_proj"]}))
    assert str(err.value).startswith("lora.targets: unknown target 'q_proj' (choose from linear_qkv, ")
    assert "\n" not in str(err.value)


def test_lora_refuses_a_reference_refresh_in_one_line():
    with pytest.raises(ConfigError) as err:
        build_config(TrainConfig, _train_cfg(lora={}, reference_refresh_interval=5))
    assert str(err.value).startswith("reference_refresh_interval: with lora the reference is the base model")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny"))


@pytest.fixture(scope="module")
def layer_math(tmp_path_factory, hf):
    from megatron_spo.models.parallel import spawn_local

    out = tmp_path_factory.mktemp("lora") / "layer_math.pt"
    spawn_local(layer_math_worker, 2, hf, {"rank": 4, "alpha": 8}, str(out))
    return torch.load(out)


@pytest.mark.multiproc
def test_adapters_keep_the_base_layers_tp_split_and_only_they_train(layer_math):
    """Column-parallel bases (qkv, fc1): A [r, in] whole, B split like the output rows; row-parallel (proj, fc2):
    A split like the input columns, B whole. Nothing but the adapters requires grad."""
    h, ffn, qkv, r = 32, 64, 32 + 2 * 16, 4  # tiny Llama: hidden 32, 4 heads (8 dims) of 2 KV groups, ffn 64
    for layout, tp in (("tp1_pp1", 1), ("tp2_pp1", 2)):
        params = layer_math["results"][layout]["params"]
        pre = "decoder.layers.0."
        assert params[pre + "self_attention.linear_qkv.lora_A"] == ((r, h), True)
        assert params[pre + "self_attention.linear_qkv.lora_B"] == ((qkv // tp, r), True)
        assert params[pre + "self_attention.linear_proj.lora_A"] == ((r, 32 // tp), True)
        assert params[pre + "self_attention.linear_proj.lora_B"] == ((h, r), True)
        assert params[pre + "mlp.linear_fc1.lora_A"] == ((r, h), True)
        assert params[pre + "mlp.linear_fc1.lora_B"] == ((2 * ffn // tp, r), True)
        assert params[pre + "mlp.linear_fc2.lora_A"] == ((r, ffn // tp), True)
        assert params[pre + "mlp.linear_fc2.lora_B"] == ((h, r), True)
        trainable = sorted(n.rsplit(".", 1)[-1] for n, (_, grad) in params.items() if grad)
        assert set(trainable) == {"lora_A", "lora_B"} and len(trainable) == 2 * 4 * 2  # 2 layers x 4 targets
    per_layer = r * (h + qkv) + r * (32 + h) + r * (h + 2 * ffn) + r * (ffn + h)
    assert layer_math["results"]["tp1_pp1"]["counts"][0]["trainable"] == 2 * per_layer == 3328


@pytest.mark.multiproc
def test_adapters_start_alike_in_every_layout_and_the_initial_policy_is_the_base(layer_math):
    results = layer_math["results"]
    first = results["tp1_pp1"]["initial"]
    assert len(first) == 2 * 4 * 2
    for layout in results:
        rec = results[layout]
        assert rec["initial"].keys() == first.keys()
        for k, t in rec["initial"].items():
            assert torch.equal(t, first[k]), (layout, k)  # drawn whole from (seed, layer, target), then sliced
            if k.endswith("lora_B"):
                assert not t.any()
            else:
                assert t.abs().max() <= 1 / t.shape[1] ** 0.5 and t.std() > 0  # Kaiming-uniform, fan_in = in
        assert torch.equal(rec["on"], rec["off"]), layout  # B = 0: the policy IS the base, bitwise
        assert torch.equal(rec["off_after"], rec["off"]), layout  # adapters off: the base, whatever they hold


@pytest.mark.multiproc
def test_adapter_math_matches_merged_weights_in_transformers_in_every_layout(layer_math, hf):
    """With random A and B, our logits (every layout) equal transformers' model holding the merged weights
    W + (alpha / r) B A that hf_map pushes and exports; with the adapters off the export is the base exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ids, results = layer_math["ids"], layer_math["results"]
    shapes = {k: tuple(v.shape) for k, v in results["tp1_pp1"]["initial"].items()}
    full = random_adapters(shapes)
    base = load_file(f"{hf}/model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    merged = results["tp1_pp1"]["merged"]
    # one merged tensor by hand (alpha / r = 2): o_proj of layer 1 is W_o + 2 B A
    layer1 = "decoder.layers.1.self_attention.linear_proj."
    torch.testing.assert_close(merged["model.layers.1.self_attn.o_proj.weight"],
                               base["model.layers.1.self_attn.o_proj.weight"]
                               + 2.0 * full[layer1 + "lora_B"] @ full[layer1 + "lora_A"], rtol=0, atol=1e-6)
    model.load_state_dict(merged)
    with torch.no_grad():
        expected = model(ids).logits
    for layout, rec in results.items():
        for k, t in rec["set"].items():
            assert torch.equal(t, full[k]), (layout, k)  # set from full tensors, gathered back whole
        torch.testing.assert_close(rec["lora"], expected, rtol=1e-5, atol=1e-5, msg=layout)
        assert (rec["lora"] - rec["off"]).abs().max() > 1e-2
        for name, t in rec["merged"].items():
            torch.testing.assert_close(t, merged[name], rtol=1e-6, atol=1e-6, msg=f"{layout}: {name}")
        for name, t in rec["merged_off"].items():
            assert torch.equal(t, base[name]), (layout, name)


def _peft_logits(hf, adapter_dir, ids):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.multiproc
def test_peft_loads_the_exported_adapter_onto_the_hf_base_and_its_logits_are_ours(layer_math, hf, tmp_path_factory):
    """The adapters TP 2 holds, exported in HF PEFT names (fused qkv split into q / k / v, fc1 into gate / up):
    peft.PeftModel on transformers' base model gives our logits (1e-5, fp32)."""
    import json

    pytest.importorskip("peft")
    from safetensors.torch import load_file

    peft_dir = next(tmp_path_factory.getbasetemp().glob("lora*/peft-tp2"))
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    tensors = load_file(peft_dir / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2  # layers x HF modules x factors
    q = "base_model.model.model.layers.0.self_attn.q_proj."
    assert tensors[q + "lora_A.weight"].shape == (4, 32) and tensors[q + "lora_B.weight"].shape == (32, 4)
    assert tensors["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (16, 4)
    assert tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].shape == (64, 4)
    logits = _peft_logits(hf, peft_dir, layer_math["ids"])
    torch.testing.assert_close(logits, layer_math["results"]["tp2_pp1"]["lora"], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# The trainer with LoRA: parity across layouts, pi_0 without a reference model, checkpoints
# ---------------------------------------------------------------------------------------------
LORA = {"rank": 4, "alpha": 8}
TRAINABLE = 3328  # the tiny Llama's adapters at rank 4 (test_adapters_keep_the_base_layers_tp_split_and_only_they_train)


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, hf):
    """SPO with LoRA, 2 steps each: TP 1 ("single"), the same without LoRA ("full"), 1 step + a resumed second
    ("resumed"), a resume of that run onto another base model ("other-base", refused); TP 2 and PP 2 (2 ranks)."""
    from lora_helpers import train_lora_and_dump
    from trainer_helpers import trainer_config

    from megatron_spo.models.parallel import spawn_local

    root = tmp_path_factory.mktemp("lora-runs")
    other = make_tiny_hf(str(tmp_path_factory.mktemp("hf-other") / "tiny"), seed=1)

    def run(name, tp=1, pp=1, steps=2, **kw):
        return trainer_config(root, hf, name, tp=tp, pp=pp, steps=steps, **{"lora": LORA, **kw}), str(root / f"{name}.pt")

    other_base = run("resumed", steps=3, init={"hf": other}, checkpoint={"interval": 100, "allow_config_change": True})
    spawn_local(train_lora_and_dump, 1, [run("single"), run("full", lora=None), run("resumed", steps=1),
                                         run("resumed"), (other_base[0], str(root / "other-base.pt"))])
    spawn_local(train_lora_and_dump, 2, [run("tp2", tp=2), run("pp2", pp=2),
                                         run("tp2sp", tp=2, parallel={"tensor_model_parallel_size": 2,
                                                                      "sequence_parallel": True})])
    return root


def _lora_record(root, name):
    return torch.load(root / f"{name}.pt.lora.pt")


@pytest.mark.multiproc
@pytest.mark.megatron
@pytest.mark.parametrize("layout", ["tp2", "pp2", "tp2sp"])
def test_lora_trains_alike_at_tp2_and_pp2(lora_runs, layout):
    """Same losses, grad norms, entropies and merged weights as one process, and the same adapters (tp2sp: TP 2 with
    sequence parallelism, where the replicated factors see a share of the tokens and are summed over TP)."""
    from test_trainer import _assert_trains_alike

    _assert_trains_alike(lora_runs, "single", layout, "spo")
    ref, got = _lora_record(lora_runs, "single")["adapters"], _lora_record(lora_runs, layout)["adapters"]
    assert got.keys() == ref.keys() and len(ref) == 2 * 4 * 2
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-6, msg=f"{layout}: {k}")
    assert min(ref[k].abs().max().item() for k in ref if k.endswith("lora_B")) > 1e-4  # B left zero: trained


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["single", "tp2", "pp2"])
def test_lora_reference_is_the_policy_with_adapters_off_bitwise_a_built_reference(lora_runs, name):
    """After 2 steps moved the adapters, pi_0's log-probs (the policy with its adapters off) equal those of a
    separately built reference model loaded from init, bitwise; no reference model exists in the trainer."""
    ranks = _lora_record(lora_runs, name)["ranks"]
    assert not any(r["reference_built"] for r in ranks)
    last = [r["reference"] for r in ranks if r["reference"]["micro_batches"]]
    assert last and all(r["bitwise"] for r in last)
    assert all(r["policy_max_diff"] > 1e-4 for r in last)  # and the policy itself is not pi_0 any more


@pytest.mark.multiproc
def test_lora_optimizer_and_memory_hold_the_adapters_only(lora_runs):
    lora, full = _lora_record(lora_runs, "single")["ranks"][0], _lora_record(lora_runs, "full")["ranks"][0]
    assert lora["counts"]["trainable"] == lora["bytes"]["optimizer_params"] == TRAINABLE
    assert lora["counts"]["frozen"] == full["counts"]["trainable"]  # the base: every parameter of the full policy
    assert full["bytes"]["optimizer_params"] == full["counts"]["trainable"] and full["reference_built"]
    # no reference copy: parameters are the policy's alone (the full run holds two models)
    policy_bytes = 4 * (lora["counts"]["frozen"] + TRAINABLE)
    assert lora["bytes"]["params"] == policy_bytes and full["bytes"]["params"] == 2 * 4 * full["counts"]["trainable"]
    assert lora["bytes"]["grads"] == 4 * TRAINABLE  # DDP's fp32 gradient buffer: the adapters'
    assert lora["bytes"]["optimizer_state"] < full["bytes"]["optimizer_state"] / 5


@pytest.mark.multiproc
def test_lora_checkpoint_holds_the_adapters_and_the_base_identity_and_resumes_exactly(lora_runs, hf):
    import json

    from megatron.core import dist_checkpointing

    single = sorted((lora_runs / "single").glob("checkpoints/*/lora_base.json"))
    assert len(single) == 1 and json.loads(single[0].read_text())["path"] == hf
    keys = dist_checkpointing.load_tensors_metadata(str(single[0].parent / "dist"))
    model_keys = [k for k in keys if k.startswith("policy.model0.")]
    # megatron stacks a key's layers into one tensor: 4 targets x 2 factors
    assert len(model_keys) == 4 * 2 and all(k.rsplit(".", 1)[-1] in ("lora_A", "lora_B") for k in model_keys)
    assert not [k for k in keys if "word_embeddings" in k or k.endswith("linear_qkv.weight")]
    straight, resumed = torch.load(lora_runs / "single.pt"), torch.load(lora_runs / "resumed.pt")
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], rtol=0, atol=1e-7, msg=k)
    a, b = _lora_record(lora_runs, "single")["adapters"], _lora_record(lora_runs, "resumed")["adapters"]
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-7, msg=k)


@pytest.mark.multiproc
def test_lora_resume_onto_another_base_model_is_refused_in_one_line(lora_runs):
    error = (lora_runs / "other-base.pt.error").read_text()
    assert error.startswith("init: the adapters in ") and "were trained on the base model " in error
    assert "\n" not in error and not (lora_runs / "other-base.pt").exists()


def test_lora_base_check_refuses_adapters_against_a_full_policy_and_back(tmp_path):
    from types import SimpleNamespace

    from megatron_spo.training.checkpoint import check_lora_base

    full = SimpleNamespace(cfg=SimpleNamespace(lora=None))
    lora = SimpleNamespace(cfg=SimpleNamespace(lora=LoraConfig()), _lora_base={"path": "/b", "digest": "d" * 64})
    assert check_lora_base(full, tmp_path) is None
    assert check_lora_base(lora, tmp_path).startswith(f"lora: {tmp_path} holds a full policy (written without lora)")
    (tmp_path / "lora_base.json").write_text('{"path": "/b", "digest": "' + "d" * 64 + '"}')
    assert check_lora_base(lora, tmp_path) is None
    assert check_lora_base(full, tmp_path).startswith(f"lora: {tmp_path} holds LoRA adapters (written with lora set)")


@pytest.mark.multiproc
def test_a_lora_run_exports_its_adapters_for_peft_and_its_merged_policy(lora_runs, hf):
    """RUN_DIR/adapter (PEFT) on the base gives the logits of RUN_DIR/hf (the merged weights W + s B A)."""
    pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    ids = torch.randint(1, 61, (2, 10), generator=torch.Generator().manual_seed(0))
    merged = AutoModelForCausalLM.from_pretrained(lora_runs / "single" / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = merged(ids).logits
    torch.testing.assert_close(_peft_logits(hf, lora_runs / "single" / "adapter", ids), expected, rtol=1e-5, atol=1e-5)
    assert (lora_runs / "single" / "adapter" / "digests.json").is_file()
