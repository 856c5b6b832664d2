"""Qwen2-MoE (models/arch/qwen2_moe.py: routed experts + a sigmoid-gated shared expert) against transformers'
Qwen2MoeForCausalLM, in odd sizes (5 experts, top-3 of a softmax over all, hidden 40, expert intermediate 22, shared
expert 26, q/k/v biases, vocab 203; a 6-expert twin for EP 2): config.json round trip, what is refused by name,
HF -> Megatron -> HF bit-exact with `megatron-spo check-conversion`, one 4-process gloo spawn for TP 1, TP 2, EP 2,
TP 2 x EP 2 and PP 2 x EP 2 (logits, gradients at TP 1, the export a weight push sends, forced routes replayed), the
local engine's routes and pushes, SGLang's own load_weights, and the parameter counts of the published models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import models_helpers  # noqa: E402
import moe_helpers  # noqa: E402
import qwen2_moe_helpers as q2  # noqa: E402

from megatron_spo.config import ConfigError  # noqa: E402
from megatron_spo.models import hf_checkpoint as hfc  # noqa: E402
from megatron_spo.models.config import ModelConfig, MoEConfig, ParallelConfig  # noqa: E402
from megatron_spo.models.hf_map import hf_shapes  # noqa: E402

pytestmark = pytest.mark.megatron
TENSORS = 3 + 2 * (2 + 6 + 1 + 1 + 5 * 3 + 4)  # embed, norm, head + per layer: norms, q/k/v + biases, o, router,
#                                                 experts, shared gate / up / down + its gate


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return q2.make_tiny_qwen2_moe(tmp_path_factory.mktemp("qwen2-moe") / "hf")


@pytest.fixture(scope="module")
def results(hf_dir, tmp_path_factory) -> dict:
    from megatron_spo.models.parallel import spawn_local

    root = tmp_path_factory.mktemp("qwen2-moe-results")
    dirs = {"e5": str(hf_dir), "e6": str(q2.make_tiny_qwen2_moe(root / "e6", num_experts=6))}
    spawn_local(q2.worker, 4, dirs, str(root / "results.json"))
    return json.loads((root / "results.json").read_text())


def test_config_json_reads_the_shared_expert_and_round_trips(hf_dir):
    cfg = hfc.read_hf_config(hf_dir)
    assert cfg.architecture == "qwen2_moe" and cfg.qkv_bias and not cfg.qk_layernorm and cfg.head_dim == 10
    moe = cfg.moe
    assert (moe.num_experts, moe.router_topk, moe.ffn_hidden_size) == (5, 3, 22)
    assert (moe.shared_expert_ffn_hidden_size, moe.shared_expert_gate, moe.norm_topk_prob) == (26, True, False)
    written = hfc.model_config_to_hf_config(cfg)
    assert written["architectures"] == ["Qwen2MoeForCausalLM"] and written["shared_expert_intermediate_size"] == 26
    assert hfc.hf_config_to_model_config(written) == cfg
    reader = hfc.HFReader(hf_dir, verify=False)
    # router, 3 tensors per expert, the shared expert's 3 and its gate per layer: nothing the checkpoint holds unmapped
    assert {n: reader.shape(n) for n in reader.names()} == hf_shapes(cfg) and len(hf_shapes(cfg)) == TENSORS
    assert hf_shapes(cfg)["model.layers.1.mlp.shared_expert_gate.weight"] == (1, 40)
    import transformers

    built = transformers.AutoConfig.for_model(**{k: v for k, v in written.items() if k != "architectures"})
    assert type(built).__name__ == "Qwen2MoeConfig" and built.qkv_bias
    assert (built.num_experts, built.num_experts_per_tok, built.moe_intermediate_size,
            built.shared_expert_intermediate_size, built.norm_topk_prob) == (5, 3, 22, 26, False)
    # the parameter count is the checkpoint's (the shared expert and its gate included)
    assert cfg.num_parameters() == sum(torch.Size(s).numel() for s in hf_shapes(cfg).values())
    # transformers 5's qkv_bias: false drops the biases from the rule table
    no_bias = hfc.hf_config_to_model_config(_raw(hf_dir, qkv_bias=False), "x/config.json")
    assert not no_bias.qkv_bias and len(hf_shapes(no_bias)) == TENSORS - 2 * 3
    assert hfc.hf_config_to_model_config(hfc.model_config_to_hf_config(no_bias)) == no_bias


def _raw(hf_dir, **changes) -> dict:
    return {**json.loads((hf_dir / "config.json").read_text()), **changes}


@pytest.mark.parametrize("changes, message", [
    ({"mlp_only_layers": [1]},
     "unsupported mlp_only_layers=[1] (supported: []; dense MLP layers between MoE layers are not built here)"),
    ({"decoder_sparse_step": 2},
     "unsupported decoder_sparse_step=2 (supported: 1; dense MLP layers between MoE layers are not built here)"),
    ({"shared_expert_intermediate_size": 0},
     "unsupported shared_expert_intermediate_size=0 (supported: a positive size; Qwen2MoeForCausalLM always builds "
     "its shared expert)"),
    ({"shared_expert_intermediate_size": None}, "missing field 'shared_expert_intermediate_size'"),
    ({"head_dim": 16},
     "unsupported head_dim=16 (supported: 10; Qwen2-MoE's head_dim is hidden_size / num_attention_heads)"),
    ({"use_sliding_window": True},
     "unsupported use_sliding_window=True (supported: False; sliding-window attention is not supported)"),
    ({"num_experts_per_tok": 6}, "num_experts_per_tok 6 is larger than num_experts 5"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act='gelu' (supported: 'silu')"),
])
def test_what_qwen2_moe_cannot_build_is_refused_by_name(hf_dir, changes, message):
    with pytest.raises(hfc.HFCheckpointError) as info:
        hfc.hf_config_to_model_config(_raw(hf_dir, **changes), "x/config.json")
    assert str(info.value).startswith("x/config.json: "), str(info.value)
    assert message in str(info.value)


def test_shared_experts_belong_to_the_family_and_split_over_tp(hf_dir):
    cfg = hfc.read_hf_config(hf_dir)
    data = cfg.model_dump()
    with pytest.raises(ValueError, match=r"architecture 'qwen2_moe': Qwen2MoeForCausalLM has experts and a gated "
                                         r"shared expert"):
        ModelConfig(**{**data, "moe": {**data["moe"], "shared_expert_ffn_hidden_size": None,
                                       "shared_expert_gate": False}})
    with pytest.raises(ValueError, match=r"architecture 'qwen3_moe': Qwen3MoeForCausalLM has no shared expert"):
        ModelConfig(**{**data, "architecture": "qwen3_moe", "qkv_bias": False, "qk_layernorm": True})
    with pytest.raises(ValueError, match="moe.shared_expert_gate needs moe.shared_expert_ffn_hidden_size"):
        MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=8, shared_expert_gate=True)
    odd = ModelConfig(**{**data, "moe": {**data["moe"], "shared_expert_ffn_hidden_size": 27}})
    with pytest.raises(ConfigError, match="parallel.tensor_model_parallel_size 2 does not divide "
                                          "model.moe.shared_expert_ffn_hidden_size 27"):
        ParallelConfig(tensor_model_parallel_size=2).check(odd, 2)
    ParallelConfig(tensor_model_parallel_size=2).check(cfg, 2)
    with pytest.raises(ConfigError, match="parallel.expert_model_parallel_size 2 does not divide "
                                          "model.moe.num_experts 5"):
        ParallelConfig(expert_model_parallel_size=2).check(cfg, 2)
    # one GPU of TP 2: attention, routed experts and the shared expert split over TP; norms, router, shared gate not
    h, q, kv, fs = 40, 40, 20, 26
    layer = (2 * h * q + 2 * h * kv + q + 2 * kv + 5 * 3 * h * 22 + 3 * h * fs) // 2 + 5 * h + h + 2 * h
    assert cfg.stage_parameters(tp=2) == 2 * layer + 2 * 256 * h // 2 + h


@pytest.mark.multiproc
def test_converts_hf_megatron_hf_bit_exactly_and_check_conversion_passes(hf_dir, tmp_path):
    code = (
        "import sys, warnings; warnings.filterwarnings('ignore')\n"
        "from megatron_spo.models.convert import hf_to_megatron, megatron_to_hf\n"
        "src, meg, back = sys.argv[1:4]\n"
        "hf_to_megatron(src, meg); megatron_to_hf(meg, back)\n"
    )
    meg, back = tmp_path / "meg", tmp_path / "back"
    models_helpers.run_cli(str(hf_dir), str(meg), str(back), code=code)
    a, b = models_helpers.all_tensors(hf_dir), models_helpers.all_tensors(back)
    assert a.keys() == b.keys() and len(a) == TENSORS
    assert all(torch.equal(a[k], b[k]) for k in a), "round trip is not bit-exact"
    assert hfc.read_hf_config(back) == hfc.read_hf_config(hf_dir)
    ids = q2.tokens(batch=2)
    with torch.no_grad():
        assert torch.equal(moe_helpers.hf_model(hf_dir)(ids).logits, moe_helpers.hf_model(back)(ids).logits)
    proc = models_helpers.run_cli("check-conversion", "--hf", str(hf_dir), "--megatron", str(meg), "--no-progress")
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith(f"OK: {TENSORS} tensors identical; 2 layers"), line


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [f"{m}_tp{tp}_pp{pp}_ep{ep}" for m, tp, pp, ep in q2.LAYOUTS])
def test_matches_transformers_in_every_layout(results, layout):
    rec = results[layout]
    # the shared expert and its gate each move transformers' logits far (0.6-0.8) beyond the tolerance, so parity
    # checks both; fp32: 1e-4 of the largest logit (measured <= 6e-7 at a largest logit of 0.49)
    assert rec["shared_changes_logits"] > 0.1 and rec["gate_changes_logits"] > 0.1, rec
    assert rec["logit_max_abs_diff"] < 1e-4 * rec["logit_scale"], rec
    # forced routes replayed: transformers' logits under the same routes
    assert rec["forced_changes_logits"] > 1e-3
    assert rec["forced_logit_max_abs_diff"] < 1e-4 * rec["logit_scale"], rec
    # the export (what a weight push sends) is exactly the checkpoint's tensors, each once
    assert rec["export_bit_exact"]
    assert sorted(rec["exported"]) == sorted(rec["checkpoint_names"])
    if "_tp1_" in layout:  # megatron-core refuses to train MoE at TP > 1 without sequence parallelism
        assert rec["grad_max_rel_diff"] < 1e-4, (rec["grad_max_rel_diff"], rec["grad_worst_tensor"])
        assert sorted(rec["grad_names"]) == sorted(rec["checkpoint_names"])


def test_the_local_engine_returns_routes_and_takes_pushes(hf_dir):
    """The local engine (transformers' model) captures every router's top-3 as it decodes (prefill, then one token per
    step: the same as one forward of the sequence), and a push of the checkpoint's names (the export's: per expert,
    the shared expert and its gate) rebuilds transformers' own loading bitwise."""
    import numpy as np

    from megatron_spo.data.routes import RoutedExperts
    from megatron_spo.rollout.local_engine import LocalEngine, Req
    from megatron_spo.rollout.protocol import SamplingParams

    engine = LocalEngine(str(hf_dir), return_routed_experts=True)
    assert (engine.routes.top_k, len(engine.routes.gates)) == (3, 2)
    reqs = [Req(prompt, SamplingParams(max_new_tokens=6, temperature=1.0), f"r{i}", routes=[])
            for i, prompt in enumerate([[5, 6, 7, 8, 9], [11, 12]])]
    engine.generate(reqs)
    model, got = moe_helpers.hf_model(hf_dir), []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: got.append(out[2]))
    for req in reqs:
        seq = req.prompt + req.output_ids
        routes = torch.cat(req.routes)
        assert routes.shape == (len(seq) - 1, 2, 3) and routes.dtype == torch.int32
        RoutedExperts.from_array(routes.numpy()).check_model(num_layers=2, num_experts=5, top_k=3, where=req.rid)
        got.clear()
        with torch.no_grad():
            model(torch.tensor([seq[:-1]]))
        own = torch.stack(got, dim=1)
        assert np.array_equal(routes.long().sort(-1).values.numpy(), own.sort(-1).values.numpy())
    cfg = hfc.read_hf_config(hf_dir)
    reader = hfc.HFReader(hf_dir, verify=False)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    engine.load_named_tensors([(name, reader.get(name)) for name in hf_shapes(cfg)])
    reference = moe_helpers.hf_model(hf_dir).state_dict()
    assert engine.model.state_dict().keys() == reference.keys()
    for name, t in reference.items():
        assert torch.equal(engine.model.state_dict()[name], t), name


def test_sglangs_qwen2_moe_loads_every_pushed_tensor(hf_dir):
    """SGLang's own Qwen2MoeForCausalLM (srt/models/qwen2_moe.py, built on CPU by tests/sglang_models.py) takes every
    name our push sends: each expert into the fused w13 / w2, the shared expert into its merged gate_up_proj, and
    shared_expert_gate; no SGLang parameter keeps an unwritten element."""
    import sglang_models as sm
    from sglang_source import SGLANG_NOT_INSTALLED

    if not sm.sglang_available():
        pytest.skip(SGLANG_NOT_INSTALLED)
    cfg = hfc.read_hf_config(hf_dir)
    reader = hfc.HFReader(hf_dir, verify=False)
    pushed = [(name, reader.get(name).clone()) for name in hf_shapes(cfg)]
    report = sm.sglang_weight_load_report("Qwen2MoeForCausalLM", json.loads((hf_dir / "config.json").read_text()),
                                          pushed)
    assert report.load_weights_file == "srt/models/qwen2_moe.py"
    assert "unlisted" not in report.stubbed_modules.values(), report.stubbed_modules
    assert report.problems(set()) == []
    assert set(report.loaded) == {name for name, _ in pushed}
    layer = "model.layers.1.mlp."
    assert report.loaded[layer + "experts.4.up_proj.weight"][0] == layer + "experts.w13_weight"
    assert report.loaded[layer + "shared_expert.up_proj.weight"][0] == layer + "shared_expert.gate_up_proj.weight"
    assert report.params[layer + "shared_expert_gate.weight"] == (1, 40)


def test_published_qwen2_moe_sizes_are_counted_with_their_shared_experts():
    """Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B (their config.json): total and active parameters to the model cards'
    digits (14.3B / 2.7B, 57.4B / 14B); the shared expert is dense (over TP, not EP) and always active."""
    from megatron_spo.planning import capacity

    def qwen2_moe(layers, h, heads, groups, dense, experts, topk, f, fs):
        return ModelConfig(architecture="qwen2_moe", num_layers=layers, hidden_size=h, ffn_hidden_size=dense,
                           num_attention_heads=heads, num_query_groups=groups, vocab_size=151936,
                           max_position_embeddings=32768, rope_theta=1e6, norm_epsilon=1e-6, params_dtype="bfloat16",
                           moe=MoEConfig(num_experts=experts, router_topk=topk, ffn_hidden_size=f,
                                         shared_expert_ffn_hidden_size=fs, shared_expert_gate=True,
                                         norm_topk_prob=False))

    small = qwen2_moe(24, 2048, 16, 16, 5632, 60, 4, 1408, 5632)  # (intermediate_size: no layer is dense)
    big = qwen2_moe(28, 3584, 28, 4, 18944, 64, 8, 2560, 20480)
    s, b = capacity.moe_counts(small), capacity.moe_counts(big)
    assert (s.total, s.active, b.total, b.active) == (14_315_784_192, 2_689_173_504, 57_408_658_944, 14_249_270_784)
    assert (round(s.total / 1e9, 1), round(s.active / 1e9, 1), round(b.total / 1e9, 1), b.active // 10**9) == (
        14.3, 2.7, 57.4, 14)
    h, fs = 2048, 5632
    shared = 24 * (3 * h * fs + h)
    assert s.total - s.experts - shared == 2 * 151936 * h + 24 * (4 * h * h + 3 * h + 60 * h + 2 * h) + h
    split = capacity.moe_stage_parameters(small, tp=2, ep=4)
    assert split.experts == 24 * 15 * 3 * h * 1408 // 2  # 60 / EP 4 experts per GPU, over TP
    assert split.dense == capacity.stage_parameters(small, 2, 1) - 24 * 60 * 3 * h * 1408 // 2
    plan = capacity.make_plan(small, ParallelConfig(expert_model_parallel_size=4, use_distributed_optimizer=True),
                              capacity.CapacityConfig())
    assert plan["model"]["parameters"] == s.total and plan["model"]["moe"]["active_parameters"] == s.active
