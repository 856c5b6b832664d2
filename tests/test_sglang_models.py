"""A weight push reaches every SGLang parameter: SGLang's real model classes (sglang/srt/models/llama.py,
mistral.py, qwen2.py, qwen3.py), built on CPU by tests/sglang_models.py, load the names our push sends.

The pushed names are the transformers model's ``state_dict()`` names (what megatron_spo/models/hf_map.py
``iter_hf_tensors`` yields) minus ``lm_head.weight`` when the config ties the embeddings (hf_map sends
no LM head then; transformers' state_dict still lists it). For each family, tied and untied, every
pushed name must be written into an SGLang parameter and no SGLang parameter may be left (partly)
unwritten. Facts pinned here (SGLang 0.5.23, TP=1):

* stacked names: q_proj/k_proj/v_proj -> qkv_proj shards "q"/"k"/"v" (weights and Qwen2's biases),
  gate_proj/up_proj -> gate_up_proj shards 0/1; every other name is the parameter's own name.
* tied embeddings: SGLang's lm_head IS model.embed_tokens (one parameter, no ``lm_head.weight``). A
  pushed ``lm_head.weight`` is skipped: silently by Llama/Mistral (``tie_word_embeddings and
  "lm_head.weight" in name: continue``) and by the v2 loader (skip_prefixes), with only a log warning
  "Parameter lm_head.weight not found in params_dict" by Qwen2/Qwen3. It never reaches the embedding.
* an unknown name: Llama/Mistral/Qwen2 skip it with that warning; Qwen3 raises KeyError when the name
  contains a stacked shard name (``params_dict[name]`` unguarded), so the engine fails the push
  (update_weights_from_distributed -> success=false, "partially updated").
* Qwen3's q_norm/k_norm are RMSNorm(head_dim) loaded by name; head_dim comes from the config, not
  hidden/heads (also Mistral-Nemo-like head_dim for Mistral, read by llama.py).
"""

from __future__ import annotations

import functools
import sys

import pytest
import sglang_source as sgl

if not sgl.sglang_available():
    pytest.skip(sgl.SGLANG_NOT_INSTALLED, allow_module_level=True)
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import sglang_models as sm  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

# case -> (SGLang architecture, transformers config class, config kwargs beyond TINY)
CASES: dict[str, tuple[str, str, dict]] = {
    "qwen2-untied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=False)),  # Qwen2.5-7B
    "qwen2-tied": ("Qwen2ForCausalLM", "Qwen2Config", dict(tie_word_embeddings=True)),  # Qwen2.5-0.5B..3B
    "llama3.2-tied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    "llama-untied": ("LlamaForCausalLM", "LlamaConfig", dict(tie_word_embeddings=False)),
    # head_dim 32 != hidden/heads 16, as in Qwen3 (e.g. 0.6B: hidden 1024, 16 heads, head_dim 128)
    "qwen3-untied": ("Qwen3ForCausalLM", "Qwen3Config", dict(tie_word_embeddings=False, head_dim=32)),
    "qwen3-tied": ("Qwen3ForCausalLM", "Qwen3Config", dict(tie_word_embeddings=True, head_dim=32)),
    "mistral-untied": ("MistralForCausalLM", "MistralConfig", dict(tie_word_embeddings=False)),  # 7B v0.1
    "mistral-nemo-like": ("MistralForCausalLM", "MistralConfig", dict(tie_word_embeddings=False, head_dim=32)),
}

# SGLang parameters that need no push because SGLang computes them itself: none for these families at
# TP=1 (the rotary cos/sin caches are buffers, not parameters; the tied LM head is the embedding).
COMPUTED_BY_SGLANG: dict[str, str] = {}

LOAD_WEIGHTS_FILE = {
    "LlamaForCausalLM": "srt/models/llama.py",
    "MistralForCausalLM": "srt/models/llama.py",  # MistralForCausalLM(LlamaForCausalLM): pass
    "Qwen2ForCausalLM": "srt/models/qwen2.py",
    "Qwen3ForCausalLM": "srt/models/qwen3.py",
}


@functools.cache
def hf_model(case: str):
    architecture, config_cls, extra = CASES[case]
    config = getattr(transformers, config_cls)(**TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == architecture
    return config, model.state_dict()


def hf_push(case: str) -> list[tuple[str, torch.Tensor]]:
    """What our push sends for this model: the names and shapes of our registry's rule table for its family
    (models/arch/; the trainer's iter_hf_tensors yields exactly these, tests/test_arch_families.py), with the
    transformers model's tensors. They must be the transformers names less lm_head.weight when tied."""
    from megatron_spo.models.hf_checkpoint import hf_config_to_model_config
    from megatron_spo.models.hf_map import hf_shapes

    config, state = hf_model(case)
    raw = {**config.to_dict(), "sliding_window": None}  # transformers' Mistral default window: not a weight matter
    ours = hf_shapes(hf_config_to_model_config(raw, case))
    assert set(ours) == {n for n in state if not (config.tie_word_embeddings and n == "lm_head.weight")}
    assert all(tuple(state[n].shape) == shape for n, shape in ours.items())
    return [(name, state[name]) for name in ours]


@functools.cache
def report(case: str, *, v2: bool = False) -> sm.Report:
    config, _ = hf_model(case)
    return sm.sglang_weight_load_report(CASES[case][0], config, hf_push(case), weight_loader_v2=v2)


def expected_target(name: str) -> tuple[str, object]:
    for hf, sglang, shard in ((".q_proj.", ".qkv_proj.", "q"), (".k_proj.", ".qkv_proj.", "k"),
                              (".v_proj.", ".qkv_proj.", "v"), (".gate_proj.", ".gate_up_proj.", 0),
                              (".up_proj.", ".gate_up_proj.", 1)):
        if hf in name:
            return name.replace(hf, sglang), shard
    return name, None


@pytest.mark.parametrize("case", list(CASES))
def test_push_writes_every_sglang_parameter(case):
    """SGLang's model class for the case (srt/models/<family>.py) loads every pushed HF name into a
    parameter (stacked ones into their shard) and no parameter is left unwritten."""
    architecture = CASES[case][0]
    config, _ = hf_model(case)
    r = report(case)
    assert r.load_weights_file == LOAD_WEIGHTS_FILE[architecture]
    assert r.problems(COMPUTED_BY_SGLANG) == []
    pushed = [name for name, _ in hf_push(case)]
    assert set(r.loaded) == set(pushed)
    assert r.loaded == {name: expected_target(name) for name in pushed}
    assert {p for _, p, _ in r.writes} == set(r.params)  # every parameter was written by a pushed name
    assert ("lm_head.weight" in r.params) is (not config.tie_word_embeddings)  # tied: lm_head IS embed_tokens
    if architecture == "Qwen3ForCausalLM":
        assert r.params["model.layers.1.self_attn.q_norm.weight"] == (config.head_dim,)
        assert r.params["model.layers.1.self_attn.qkv_proj.weight"] == (
            (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim, config.hidden_size)
    if architecture == "Qwen2ForCausalLM":
        assert r.loaded["model.layers.0.self_attn.v_proj.bias"] == ("model.layers.0.self_attn.qkv_proj.bias", "v")


@pytest.mark.parametrize("case", ["qwen2-untied", "qwen2-tied", "llama3.2-tied", "mistral-untied"])
def test_weight_loader_v2_loads_the_same(case):
    """Under SGLANG_ENABLE_WEIGHT_LOADER_V2=1 (model_loader/auto_loader.py + the modules' own
    load_weights; off by default) the same push is complete too and lands on the same parameters."""
    r = report(case, v2=True)
    assert r.problems(COMPUTED_BY_SGLANG) == []
    assert {name: target[0] for name, target in r.loaded.items()} == {
        name: target[0] for name, target in report(case).loaded.items()}


@pytest.mark.parametrize("case", ["qwen2-tied", "llama3.2-tied", "qwen3-tied"])
def test_tied_model_skips_a_pushed_lm_head(case):
    """A tied model pushed lm_head.weight anyway: SGLang skips it (Llama: silently; Qwen2/Qwen3: one log
    warning) and it never reaches the embedding, which only model.embed_tokens.weight writes."""
    architecture = CASES[case][0]
    config, state = hf_model(case)
    pushed = hf_push(case) + [("lm_head.weight", torch.randn_like(state["lm_head.weight"]))]
    r = sm.sglang_weight_load_report(architecture, config, pushed)
    assert r.skipped == ["lm_head.weight"] and not r.rejected
    assert [name for name, p, _ in r.writes if p == "model.embed_tokens.weight"] == ["model.embed_tokens.weight"]
    assert r.untouched_params == r.partial_params == []
    if architecture == "LlamaForCausalLM":
        assert r.silently_skipped == ["lm_head.weight"]
    else:
        assert r.warnings == {"lm_head.weight": ["Parameter lm_head.weight not found in params_dict"]}


def test_report_catches_missing_and_misspelt_names():
    """The report can fail: a Qwen3 push without layer 0's q_norm leaves that RMSNorm weight untouched;
    a misspelt name is skipped (Llama/Qwen2, with a warning) or rejected (Qwen3: KeyError, the engine
    fails the push); an untied model without lm_head leaves it untouched; a missing v_proj leaves
    qkv_proj partly written."""
    config, _ = hf_model("qwen3-untied")
    q_norm = "model.layers.0.self_attn.q_norm.weight"
    r = sm.sglang_weight_load_report("Qwen3ForCausalLM", config, [(n, t) for n, t in hf_push("qwen3-untied")
                                                                   if n != q_norm])
    assert r.untouched_params == [q_norm]
    assert r.problems() == [f"untouched parameter {q_norm}"]

    misspelt = ("model.layers.1.self_attn.q_proj.weigth", torch.zeros(4))
    r = sm.sglang_weight_load_report("Qwen3ForCausalLM", config, hf_push("qwen3-untied") + [misspelt])
    assert r.rejected == {misspelt[0]: "KeyError: 'model.layers.1.self_attn.qkv_proj.weigth'"}

    config, _ = hf_model("llama-untied")
    layernorm = "model.layers.0.input_layernorm.weight"
    pushed = [(n, t) for n, t in hf_push("llama-untied") if n not in (layernorm, "lm_head.weight")]
    r = sm.sglang_weight_load_report("LlamaForCausalLM", config, pushed + [(layernorm + "x", torch.ones(64))])
    assert r.skipped == [layernorm + "x"]
    assert r.warnings == {layernorm + "x": [f"Parameter {layernorm}x not found in params_dict"]}
    assert sorted(r.untouched_params) == sorted([layernorm, "lm_head.weight"])

    config, _ = hf_model("qwen2-untied")
    v_proj = "model.layers.1.self_attn.v_proj.weight"
    r = sm.sglang_weight_load_report("Qwen2ForCausalLM", config, [(n, t) for n, t in hf_push("qwen2-untied")
                                                                   if n != v_proj])
    assert r.partial_params == ["model.layers.1.self_attn.qkv_proj.weight"] and not r.untouched_params
    with pytest.raises(ValueError, match="NaN"):
        sm.sglang_weight_load_report("Qwen2ForCausalLM", config, [(v_proj, torch.full((32, 64), float("nan")))])


def test_worker_uses_documented_stubs_only():
    """Every SGLang module the worker stubbed is a documented choice (tests/sglang_models.py
    MODEL_STUBBED_MODULES or tests/sglang_source.py STUBBED_MODULES), none 'unlisted'; a report loads no
    sglang module into the test process (the model code runs in the worker)."""
    before = {k for k in sys.modules if k == "sglang" or k.startswith("sglang.")}
    config, _ = hf_model("qwen3-untied")
    stubs = sm.sglang_weight_load_report("Qwen3ForCausalLM", config, hf_push("qwen3-untied")).stubbed_modules
    assert stubs and "unlisted" not in stubs.values(), stubs
    assert set(stubs.values()) <= set(sm.MODEL_STUBBED_MODULES) | set(sgl.STUBBED_MODULES)
    for real in ("sglang.srt.models.qwen3", "sglang.srt.layers.linear", "sglang.srt.model_loader.weight_utils"):
        assert real not in stubs
    assert {k for k in sys.modules if k == "sglang" or k.startswith("sglang.")} == before
