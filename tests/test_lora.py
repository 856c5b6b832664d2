"""LoRA on the policy (models/lora.py, issue 46): config, the tensor-parallel adapter layers, pi_0 with the adapters
off, training parity across layouts, checkpoints."""

import pytest
import torch
from lora_helpers import LAYOUTS, layer_math_worker, random_adapters
from trainer_helpers import make_tiny_hf

from megatron_spo.config import ConfigError, build_config
from megatron_spo.models.lora import TARGETS, LoraConfig


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


def test_layouts_cover_tp_and_pp():
    assert set(LAYOUTS) == {(1, 1), (2, 1), (1, 2)}
