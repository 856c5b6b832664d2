"""Qwen3-MoE (models/arch/qwen3_moe.py) against transformers' Qwen3MoeForCausalLM, in odd sizes (6 experts, top-2,
hidden 37, expert intermediate 22): config.json round trip, what is refused by name, HF -> Megatron -> HF bit-exact
with check-conversion, and one 4-process gloo spawn for TP 1, TP 2, EP 2, TP 2 x EP 2 and PP 2 x EP 2 (logits,
gradients where megatron-core can train, the streaming export a weight push sends, and rollout routing replay:
forced routes against transformers' model forced to the same routes). Routes of a trajectory (data/routes.py):
SGLang's layout and one-line errors naming the trajectory and field."""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import models_helpers  # noqa: E402
import moe_helpers as moe  # noqa: E402

from megatron_spo.config import ConfigError  # noqa: E402
from megatron_spo.models import hf_checkpoint as hfc  # noqa: E402
from megatron_spo.models.config import ModelConfig, ParallelConfig  # noqa: E402
from megatron_spo.models.hf_map import hf_shapes  # noqa: E402

pytestmark = pytest.mark.megatron


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return moe.make_tiny_moe(tmp_path_factory.mktemp("moe") / "hf")


@pytest.fixture(scope="module")
def results(hf_dir, tmp_path_factory) -> dict:
    from megatron_spo.models.parallel import spawn_local

    out = tmp_path_factory.mktemp("moe-results") / "results.json"
    spawn_local(moe.moe_worker, 4, str(hf_dir), str(out))
    return json.loads(out.read_text())


def test_config_json_reads_the_experts_and_round_trips(hf_dir):
    cfg = hfc.read_hf_config(hf_dir)
    assert cfg.architecture == "qwen3_moe" and cfg.qk_layernorm and cfg.head_dim == 12
    assert (cfg.moe.num_experts, cfg.moe.router_topk, cfg.moe.ffn_hidden_size) == (6, 2, 22)
    assert cfg.moe.norm_topk_prob and cfg.moe.aux_loss_coeff == 0.0  # output_router_logits false: no aux loss
    written = hfc.model_config_to_hf_config(cfg)
    assert written["architectures"] == ["Qwen3MoeForCausalLM"] and written["num_experts"] == 6
    assert hfc.hf_config_to_model_config(written) == cfg
    reader = hfc.HFReader(hf_dir, verify=False)
    # router + 3 tensors per expert per layer, and nothing else the checkpoint holds is left unmapped
    assert {n: reader.shape(n) for n in reader.names()} == hf_shapes(cfg)
    assert sum(".mlp.experts." in n for n in hf_shapes(cfg)) == 2 * 6 * 3
    import transformers

    built = transformers.AutoConfig.for_model(**{k: v for k, v in written.items() if k != "architectures"})
    assert type(built).__name__ == "Qwen3MoeConfig"
    assert (built.num_experts, built.num_experts_per_tok, built.moe_intermediate_size) == (6, 2, 22)
    # the parameter count is the checkpoint's
    assert cfg.num_parameters() == sum(torch.Size(s).numel() for s in hf_shapes(cfg).values())


def _raw(hf_dir, **changes) -> dict:
    return {**json.loads((hf_dir / "config.json").read_text()), **changes}


@pytest.mark.parametrize("changes, message", [
    ({"mlp_only_layers": [1]},
     "unsupported mlp_only_layers=[1] (supported: []; dense MLP layers between MoE layers are not built here)"),
    ({"decoder_sparse_step": 2},
     "unsupported decoder_sparse_step=2 (supported: 1; dense MLP layers between MoE layers are not built here)"),
    ({"num_nextn_predict_layers": 1},
     "unsupported num_nextn_predict_layers=1 (supported: 0; multi-token prediction layers are not built here)"),
    ({"shared_expert_intermediate_size": 16},
     "unsupported shared_expert_intermediate_size=16 (supported: 0; shared experts are not built here)"),
    ({"num_experts_per_tok": 7},
     "num_experts_per_tok 7 is larger than num_experts 6"),
])
def test_what_qwen3_moe_cannot_build_is_refused_by_name(hf_dir, changes, message):
    with pytest.raises(hfc.HFCheckpointError) as info:
        hfc.hf_config_to_model_config(_raw(hf_dir, **changes), "x/config.json")
    assert str(info.value).startswith("x/config.json: "), str(info.value)
    assert message in str(info.value)


def test_experts_on_a_dense_family_and_bad_expert_layouts_are_refused(hf_dir):
    cfg = hfc.read_hf_config(hf_dir)
    dense = cfg.model_dump(exclude={"moe"})
    with pytest.raises(ValueError, match=r"architecture 'qwen3_moe': .* moe set"):
        ModelConfig(**dense)
    with pytest.raises(ValueError, match=r"moe: architecture 'qwen3' has no experts \(a mixture-of-experts family: "
                                         r"qwen2_moe, qwen3_moe\)"):
        ModelConfig(**{**dense, "architecture": "qwen3", "moe": cfg.moe.model_dump()})
    with pytest.raises(ConfigError, match="parallel.expert_model_parallel_size 4 does not divide model.moe.num_experts 6"):
        ParallelConfig(expert_model_parallel_size=4).check(cfg, 4)
    with pytest.raises(ConfigError, match="world size 2 is not divisible by tensor_model_parallel_size 1 x "
                                          "expert_model_parallel_size 3"):
        ParallelConfig(expert_model_parallel_size=3).check(cfg, 2)
    ParallelConfig(tensor_model_parallel_size=2).check(cfg, 2)  # a forward at TP 2 is fine; training is not:
    with pytest.raises(ConfigError, match=r"parallel: a mixture-of-experts model trains at tensor_model_parallel_size "
                                          r"2 only with parallel.sequence_parallel"):
        ParallelConfig(tensor_model_parallel_size=2).check_training(cfg)
    ParallelConfig(expert_model_parallel_size=2).check_training(cfg)  # EP trains (tests/test_moe_layouts.py)
    allgather = cfg.model_copy(update={"moe": cfg.moe.model_copy(update={"token_dispatcher": "allgather"})})
    with pytest.raises(ConfigError, match=r"model.moe.token_dispatcher: allgather needs equal token counts on every "
                                          r"rank of an expert group"):
        ParallelConfig(expert_model_parallel_size=2).check_training(allgather)
    dense_cfg = hfc.read_hf_config(models_helpers.make_tiny_family(hf_dir.parent / "qwen3", "qwen3", num_layers=1))
    ParallelConfig(tensor_model_parallel_size=2).check_training(dense_cfg)
    with pytest.raises(ConfigError, match="expert_model_parallel_size 2 needs a mixture-of-experts model"):
        ParallelConfig(expert_model_parallel_size=2).check(dense_cfg, 2)


@pytest.mark.multiproc
def test_converts_hf_megatron_hf_bit_exactly_and_check_conversion_passes(hf_dir, tmp_path):
    code = (
        "import sys, json, warnings; warnings.filterwarnings('ignore')\n"
        "from megatron_spo.models.convert import hf_to_megatron, megatron_to_hf\n"
        "from megatron_spo.models.check_conversion import run_check\n"
        "src, meg, back = sys.argv[1:4]\n"
        "hf_to_megatron(src, meg); megatron_to_hf(meg, back)\n"
        "r = run_check(src, meg, progress=False)\n"
        "print(json.dumps({'ok': r.ok, 'summary': r.summary()}))\n"
    )
    meg, back = tmp_path / "meg", tmp_path / "back"
    proc = models_helpers.run_cli(str(hf_dir), str(meg), str(back), code=code)
    check = json.loads(proc.stdout.strip().splitlines()[-1])
    assert check["ok"], check["summary"]
    assert check["summary"].startswith("OK: 57 tensors identical; 2 layers"), check["summary"]
    a, b = models_helpers.all_tensors(hf_dir), models_helpers.all_tensors(back)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "round trip is not bit-exact"
    assert hfc.read_hf_config(back) == hfc.read_hf_config(hf_dir)
    ids = moe.tokens(batch=2)
    with torch.no_grad():
        assert torch.equal(moe.hf_model(hf_dir)(ids).logits, moe.hf_model(back)(ids).logits)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [f"tp{tp}_pp{pp}_ep{ep}" for tp, pp, ep in moe.LAYOUTS])
def test_matches_transformers_in_every_layout(results, layout):
    rec = results[layout]
    # fp32: 1e-4 of the largest logit (measured ~2.6e-7 of it)
    assert rec["logit_max_abs_diff"] < 1e-4 * rec["logit_scale"], rec
    assert rec["export_bit_exact"]
    # the export (what a weight push sends) is exactly the checkpoint's tensors, each once: every expert's
    assert sorted(rec["exported"]) == sorted(rec["checkpoint_names"])
    if layout.startswith("tp1"):  # MoE at TP > 1 trains with SP only: tests/test_moe_layouts.py
        assert rec["grad_max_rel_diff"] < 1e-4, (rec["grad_max_rel_diff"], rec["grad_worst_tensor"])
        assert sorted(rec["grad_names"]) == sorted(rec["checkpoint_names"])


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", [f"tp{tp}_pp{pp}_ep{ep}" for tp, pp, ep in moe.LAYOUTS])
def test_routing_replay_forces_the_routes_forward_and_backward(results, layout):
    rec = results[layout]
    # forced routes move the logits far (3.6e-2) from the model's own routing; replayed, megatron's logits are
    # transformers' under the same forced routes (token order, layer mapping across pipeline stages, EP)
    assert rec["forced_changes_logits"] > 1e-2
    assert rec["forced_logit_max_abs_diff"] < 1e-4 * rec["logit_scale"], rec
    # a row whose routes are -1 (no routes: offline data) routes itself, the other rows stay replayed
    assert rec["mixed_rows_diff"] < 1e-6, rec["mixed_rows_diff"]
    if "own_routes_replayed_bitwise" in rec:  # the routers' own choice, recorded and replayed: nothing changes
        assert rec["own_routes_replayed_bitwise"] and rec["own_routes_shape"] == [4 * moe.SEQ, 2, 2]
    if layout.startswith("tp1"):  # the gradient flows through the forced experts' router probabilities
        assert rec["forced_grad_max_rel_diff"] < 1e-4, rec["forced_grad_max_rel_diff"]


# ---------------------------------------------------------------------------------------------
# Routes of a trajectory (data/routes.py)
# ---------------------------------------------------------------------------------------------
def test_routes_keep_sglangs_layout_and_refuse_what_cannot_be_this_models():
    import base64

    import numpy as np

    from megatron_spo.data.routes import RoutedExperts, RoutesError

    ids = np.arange(5 * 2 * 2, dtype=np.int32).reshape(5, 2, 2) % 6
    b64 = base64.b64encode(ids.tobytes()).decode()  # what SGLang's detokenizer sends
    routes = RoutedExperts.from_engine(b64, tokens=5, top_k=2, where="engine 0 rid r1")
    assert (routes.tokens, routes.layers, routes.top_k, routes.b64) == (5, 2, 2, b64)
    assert np.array_equal(routes.array(), ids)
    assert RoutedExperts.from_json(routes.to_json(), "t.jsonl:3", tokens=5) == routes
    assert np.array_equal(routes.check_model(num_layers=2, num_experts=6, top_k=2, where="t"), ids)

    def error(fn) -> str:
        with pytest.raises(RoutesError) as info:
            fn()
        return str(info.value)

    assert error(lambda: RoutedExperts.from_engine(b64, tokens=6, top_k=2, where="engine 0 rid r1")) == (
        "engine 0 rid r1: field 'routed_experts': 20 expert ids do not split into 6 tokens x layers x top_k 2")
    assert error(lambda: RoutedExperts.from_json(routes.to_json(), "t.jsonl:3", tokens=7)) == (
        "t.jsonl:3: field 'routed_experts': routes for 5 tokens, but prompt + response - 1 = 7 tokens went "
        "through the model")
    assert error(lambda: RoutedExperts.from_json({**routes.to_json(), "b64": "@@"}, "t.jsonl:3", tokens=5)) == (
        "t.jsonl:3: field 'routed_experts': not valid base64")
    assert error(lambda: routes.check_model(num_layers=3, num_experts=6, top_k=2, where="trajectory 7")) == (
        "trajectory 7: field 'routed_experts': routes of 2 layers x top_k 2, the model has 3 MoE layers x top_k 2 "
        "(routes from another model?)")
    assert error(lambda: routes.check_model(num_layers=2, num_experts=5, top_k=2, where="trajectory 7")) == (
        "trajectory 7: field 'routed_experts': expert id 5 at token 1, layer 0 is outside [0, 5)")
    same = RoutedExperts.from_array(np.zeros((5, 2, 2), dtype=np.int32))
    assert error(lambda: same.check_model(num_layers=2, num_experts=6, top_k=2, where="trajectory 7")) == (
        "trajectory 7: field 'routed_experts': token 0, layer 0 routes to expert [0, 0] more than once")


# ---------------------------------------------------------------------------------------------
# The local engine returns routes as SGLang does (rollout/local_engine.py, engine_server.py)
# ---------------------------------------------------------------------------------------------
def _sglang_extract():
    """SGLang's own decoder of meta_info['routed_experts'] (srt/state_capturer/routed_experts.py)."""
    import numpy as np
    import pybase64
    import sglang_source

    path = sglang_source.sglang_root() + "/srt/state_capturer/routed_experts.py"
    return sglang_source.compile_definitions(path, ["extract_routed_experts_from_meta_info"],
                                             {"np": np, "pybase64": pybase64})["extract_routed_experts_from_meta_info"]


@functools.cache
def _routing_model(hf_dir):
    model, got = moe.hf_model(hf_dir), []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: got.append(out[2]))
    return model, got


def _own_routes(hf_dir, seq: list[int]) -> torch.Tensor:
    """transformers' routing of seq[:-1] in one forward: int64 [len - 1, layers, top_k]."""
    model, got = _routing_model(hf_dir)
    got.clear()
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]))
    return torch.stack(got, dim=1)


def test_engine_returns_routed_experts_in_sglangs_format(hf_dir):
    import sglang_source
    from rollout_helpers import ServerThread

    from megatron_spo.data.routes import RoutedExperts
    from megatron_spo.rollout.client import post_json
    from megatron_spo.rollout.local_engine import LocalEngine
    from megatron_spo.rollout.protocol import GenerateRequest, SamplingParams, parse_generate_response

    if not sglang_source.sglang_available():
        pytest.skip(sglang_source.SGLANG_NOT_INSTALLED)
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    req = GenerateRequest(input_ids=prompts, sampling_params=SamplingParams(max_new_tokens=7, n=2, temperature=1.0),
                          return_routed_experts=True)
    body = req.to_json()
    parsed = sglang_source.parse_http_body(sglang_source.io_struct().GenerateReqInput, body)
    assert (parsed.return_routed_experts, parsed.routed_experts_start_len) == (True, 0)
    extract = _sglang_extract()
    with ServerThread(LocalEngine(str(hf_dir), return_routed_experts=True)) as server:
        status, out = post_json(f"{server.url}/generate", body, 60)
        assert status == 200, out
        groups = parse_generate_response(out, 2, 2)
        late = GenerateRequest(input_ids=prompts[0], sampling_params=SamplingParams(max_new_tokens=3, temperature=0),
                               return_routed_experts=True, routed_experts_start_len=2)
        status, late_out = post_json(f"{server.url}/generate", late.to_json(), 60)
        assert status == 200, late_out
        bad = GenerateRequest(input_ids=prompts[1], return_routed_experts=True, routed_experts_start_len=3)
        status, refused = post_json(f"{server.url}/generate", bad.to_json(), 60)
        assert status == 400 and "routed_experts_start_len=3 is higher than the number of input tokens" in str(refused)
        group, metrics = _manager_group(server.url)  # the rollout manager's trajectories carry them
    assert metrics.failed_requests == 0 and len(group) == 2
    for t in group:
        r = t.routed_experts
        assert (r.tokens, r.layers, r.top_k) == (len(t.prompt_tokens) + len(t.response_tokens) - 1, 2, 2)
        own = _own_routes(hf_dir, t.prompt_tokens + t.response_tokens)
        assert torch.equal(torch.from_numpy(r.array()).long().sort(-1).values, own.sort(-1).values)
    for prompt, group in zip(prompts, groups):
        for c in group:
            seq = prompt + c.output_ids
            ids = extract({"meta_info": {"routed_experts": c.routed_experts}})  # int32, flat as SGLang hands it
            assert ids.dtype.name == "int32" and ids.size == (len(seq) - 1) * 2 * 2
            routes = RoutedExperts.from_engine(c.routed_experts, tokens=len(seq) - 1, top_k=2, where="engine")
            assert routes.layers == 2
            # decoding a batch (left-padded prefill, then one token per step) routes as one forward of the sequence
            own = _own_routes(hf_dir, seq)
            assert torch.equal(torch.from_numpy(routes.array()).long().sort(-1).values, own.sort(-1).values)
    late_c = parse_generate_response(late_out, 1, 1)[0][0]
    whole = _own_routes(hf_dir, prompts[0] + late_c.output_ids)
    late_routes = RoutedExperts.from_engine(late_c.routed_experts, tokens=whole.shape[0] - 2, top_k=2, where="e")
    assert torch.equal(torch.from_numpy(late_routes.array()).long().sort(-1).values, whole[2:].sort(-1).values)


def _manager_group(url: str):
    """One group of 2 samples from the rollout manager asking for routes (top_k 2), and its metrics."""
    import asyncio

    from megatron_spo.rollout.config import RolloutConfig
    from megatron_spo.rollout.manager import Prompt, RolloutManager

    async def go():
        manager = RolloutManager(RolloutConfig(samples_per_prompt=2, max_new_tokens=5, max_inflight_requests=1,
                                               max_retries=0), [Prompt("p", [3, 4, 5], problem=0)],
                                 lambda problem, text: 0.0, endpoints=[url], routed_experts_top_k=2)
        await manager.start(max_requests=1)
        await manager.join()
        group = manager.buffer.get_nowait() if not manager.buffer.empty() else []
        await manager.stop()
        return group, manager.metrics

    return asyncio.run(go())


def test_engine_without_the_flag_returns_no_routes_and_the_manager_says_so(hf_dir, caplog):
    from rollout_helpers import ServerThread

    from megatron_spo.rollout.local_engine import LocalEngine, Req
    from megatron_spo.rollout.protocol import SamplingParams

    engine = LocalEngine(str(hf_dir))
    assert engine.routes is None
    (req,) = engine.generate([Req([3, 4], SamplingParams(max_new_tokens=2), "r", routes=None)])
    assert req.routes is None and len(req.output_ids) == 2
    with ServerThread(engine) as server, caplog.at_level("ERROR", logger="megatron_spo.rollout"):
        group, metrics = _manager_group(server.url)
    assert group == [] and metrics.failed_requests == 1  # not retried
    assert "returned no routed_experts: start the engines with --enable-return-routed-experts, or set " \
           "routing_replay: off" in caplog.text
    dense = models_helpers.make_tiny_family(hf_dir.parent / "qwen3-dense", "qwen3", num_layers=1)
    with pytest.raises(ValueError, match="--enable-return-routed-experts: the model has no mixture-of-experts routers"):
        LocalEngine(str(dense), return_routed_experts=True)


# ---------------------------------------------------------------------------------------------
# The trainer replays a trajectory's routes (training/trainer.py, TrainConfig.routing_replay)
# ---------------------------------------------------------------------------------------------
@pytest.mark.multiproc
def test_spo_step_replays_the_trajectories_routes(hf_dir, tmp_path):
    """Behaviour log-probs are transformers' under random forced routes: a trainer replaying the routes reproduces
    them (the gap the trainer logs: ~2e-7, packed or padded), one routing itself is ~1e-2 off; pi_0 replays too, so
    at the initial weights the log-ratio is exactly 0."""
    from megatron_spo.models.parallel import spawn_local

    runs = {name: moe.train_cfg(str(tmp_path / name), str(hf_dir), replay, pack=pack)
            for name, replay, pack in (("packed", "engine", True), ("off", "off", True), ("padded", "engine", False))}
    spawn_local(moe.train_gap_worker, 1, [(cfg, str(hf_dir)) for cfg in runs.values()], None)
    m = {name: json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0]) for name in runs}
    for name in ("packed", "padded"):
        assert m[name]["logprob_gap/mean_abs"] < 1e-6 and m[name]["logprob_gap/max_abs"] < 2e-6, (name, m[name])
        assert m[name]["mean_seq_log_ratio"] == 0.0 and m[name]["kl"] == 0.0, name  # pi_0 under the same routes
    assert m["off"]["logprob_gap/mean_abs"] > 1e-3 and m["off"]["logprob_gap/max_abs"] > 1e-2, m["off"]
    assert m["padded"]["grad_norm"] == pytest.approx(m["packed"]["grad_norm"], rel=1e-5)
    assert m["off"]["grad_norm"] != pytest.approx(m["packed"]["grad_norm"], rel=1e-3)  # replay moved the gradient


def test_routes_that_cannot_be_the_models_stop_the_step_in_one_line(hf_dir):
    import numpy as np

    from megatron_spo.data.routes import RoutedExperts, RoutesError
    from megatron_spo.data.trajectory import Trajectory
    from megatron_spo.training.trainer import check_routes

    cfg = hfc.read_hf_config(hf_dir)

    def traj(ids) -> Trajectory:
        return Trajectory(prompt_id="p7", prompt_tokens=[1, 2, 3], response_tokens=[4, 5], reward=0.0,
                          source="online", policy_version=0, routed_experts=RoutedExperts.from_array(ids))

    check_routes([traj(np.zeros((4, 2, 2), np.int32) + [0, 1])], cfg)  # fits: nothing raised
    with pytest.raises(RoutesError) as info:
        check_routes([traj(np.zeros((4, 2, 2), np.int32) + [0, 1]), traj(np.full((4, 3, 2), 0, np.int32) + [0, 1])],
                     cfg)
    assert str(info.value) == (
        "trajectory 1 of the step (prompt_id 'p7', source 'online'): field 'routed_experts': routes of 3 layers x "
        "top_k 2, the model has 2 MoE layers x top_k 2 (routes from another model?)")
    with pytest.raises(RoutesError, match=r"trajectory 0 .*: field 'routed_experts': expert id 6 at token 0, layer 1 "
                                          r"is outside \[0, 6\)"):
        check_routes([traj(np.array([[[0, 1], [2, 6]]] * 4, np.int32))], cfg)
    # a record file's routes are checked against their trajectory when read
    from megatron_spo.data.trajectory import RecordError, validate_record

    record = traj(np.zeros((4, 2, 2), np.int32) + [0, 1]).to_dict()
    assert validate_record(record, "t.jsonl:1").routed_experts.array().shape == (4, 2, 2)
    with pytest.raises(RecordError) as info:
        validate_record({**record, "response_tokens": [4, 5, 6]}, "t.jsonl:2")
    assert str(info.value) == ("t.jsonl:2: field 'routed_experts': routes for 4 tokens, but prompt + response - 1 = "
                               "5 tokens went through the model")


def test_the_offline_store_and_the_archive_keep_routes_bit_exactly(tmp_path):
    """routed_experts survive the offline store and the experience archive: the same int32 ids and base64, rows
    without routes beside them; ids stored in the smallest dtype (uint8 for < 256 experts, int32 for a negative
    one); a store without routes stays version 2; a shard whose ids do not fill the row is refused naming the row
    and field."""
    import json

    import numpy as np

    from megatron_spo.data.archive import ExperienceArchive
    from megatron_spo.data.offline_store import OfflineStore, StoreError, iter_records, write_store
    from megatron_spo.data.routes import RoutedExperts
    from megatron_spo.data.trajectory import RecordError, Trajectory

    rng = np.random.default_rng(0)

    def traj(i, routes):
        return Trajectory(prompt_id=f"p{i}", prompt_tokens=[1, 2, 3], response_tokens=[4, 5][: 1 + i % 2],
                          reward=float(i), source="online", policy_version=i,
                          routed_experts=None if routes is None else RoutedExperts.from_array(routes))

    ids = [rng.permuted(np.tile(np.arange(6), (3 + i % 2, 2, 1)), axis=-1)[..., :2] for i in range(5)]
    records = [traj(i, None if i == 2 else ids[i]) for i in range(5)]
    write_store(records, tmp_path / "s", rows_per_shard=3)
    for back in (OfflineStore(tmp_path / "s").trajectories(), list(iter_records(tmp_path / "s")),
                 [OfflineStore(tmp_path / "s").record(i) for i in range(5)]):
        assert [r.routed_experts for r in back] == [r.routed_experts for r in records]  # b64 strings equal
        assert all(np.array_equal(b.routed_experts.array(), ids[i]) for i, b in enumerate(back) if i != 2)
    assert np.load(tmp_path / "s" / "shard-00000" / "routes.npy").dtype == np.uint8
    assert json.loads((tmp_path / "s" / "index.json").read_text())["version"] == 3

    wide = RoutedExperts.from_array(np.array([[[-1, 300]], [[7, 70000]], [[0, 1]]]))
    write_store([traj(1, None), traj(0, wide.array())], tmp_path / "w")
    assert [r.routed_experts for r in iter_records(tmp_path / "w")] == [None, wide]
    with pytest.raises(StoreError) as err:  # 3 routed positions, prompt + response - 1 = 4
        write_store([traj(1, wide.array())], tmp_path / "bad")
    assert str(err.value) == ("offline store: record 0 (prompt_id 'p1'): field 'routed_experts': routes for 3 tokens, "
                              "but prompt + response - 1 = 4 tokens went through the model")
    assert np.load(tmp_path / "w" / "shard-00000" / "routes.npy").dtype == np.int32
    write_store([traj(0, None)], tmp_path / "dense")
    assert json.loads((tmp_path / "dense" / "index.json").read_text())["version"] == 2
    assert not (tmp_path / "dense" / "shard-00000" / "routes.npy").exists()

    archive = ExperienceArchive(tmp_path / "exp", run_id="r1", model="m")
    archive.add(records)
    archive.close()
    assert [r.routed_experts for r in iter_records(tmp_path / "exp")] == [r.routed_experts for r in records]

    shard = tmp_path / "s" / "shard-00000"
    shape = np.load(shard / "routes_shape.npy")
    shape[1] = (3, 2)  # row 1 claims 3 layers: its ids fill 2
    np.save(shard / "routes_shape.npy", shape)
    with pytest.raises(RecordError) as info:
        OfflineStore(tmp_path / "s", verify=False)
    assert str(info.value) == (f"{shard} row 1: field 'routed_experts': the expert ids do not fill prompt + response - 1 "
                               "tokens x layers x top_k")


def test_sglangs_qwen3_moe_loads_every_pushed_expert(hf_dir):
    """SGLang's own Qwen3MoeForCausalLM (srt/models/qwen3_moe.py, built on CPU by tests/sglang_models.py) takes the
    names and tensors our push sends (at EP 2 too: the export there is these tensors bitwise,
    test_matches_transformers_in_every_layout): every name loads, each expert's gate / up into its rows of the fused
    w13_weight [E, 2F, H] and down into w2_weight [E, H, F], and no SGLang parameter keeps an unwritten element."""
    import sglang_models as sm
    from sglang_source import SGLANG_NOT_INSTALLED

    if not sm.sglang_available():
        pytest.skip(SGLANG_NOT_INSTALLED)
    cfg = hfc.read_hf_config(hf_dir)
    reader = hfc.HFReader(hf_dir, verify=False)
    pushed = [(name, reader.get(name).clone()) for name in hf_shapes(cfg)]
    report = sm.sglang_weight_load_report("Qwen3MoeForCausalLM", json.loads((hf_dir / "config.json").read_text()),
                                          pushed)
    assert report.load_weights_file == "srt/models/qwen3_moe.py"
    assert "unlisted" not in report.stubbed_modules.values(), report.stubbed_modules
    assert report.problems(set()) == []
    assert set(report.loaded) == {name for name, _ in pushed}
    layer = "model.layers.1.mlp."
    assert report.loaded[layer + "experts.5.up_proj.weight"][0] == layer + "experts.w13_weight"
    assert report.loaded[layer + "experts.5.down_proj.weight"][0] == layer + "experts.w2_weight"
    assert report.params[layer + "experts.w13_weight"] == (6, 44, 37) and report.params[layer + "gate.weight"] == (6, 37)


def test_quickstart_runs_a_tiny_moe_by_one_field(tmp_path):
    """reference.architecture=qwen3_moe: the reference is a tiny Qwen3-MoE (TINY_MOE: 6 experts of 96, top-2), the
    trainer config it makes passes the trainer's rules, and the fleet's engines get --enable-return-routed-experts
    (the run's routing_replay is engine); a dense reference gets no flag, and moe on a dense family is refused."""
    from pydantic import ValidationError

    from megatron_spo.data.char_tokenizer import build_char_tokenizer
    from megatron_spo.experiments.config import TINY_MOE, QuickstartModelConfig
    from megatron_spo.experiments.quickstart import QuickstartConfig, engine_routing_flags
    from megatron_spo.experiments.reference_model import cache_key, reference_hf_config

    cfg = QuickstartConfig.model_validate({"reference": {"architecture": "qwen3_moe"}})
    assert cfg.reference.moe == TINY_MOE and (TINY_MOE.num_experts, TINY_MOE.router_topk) == (6, 2)
    tokenizer = build_char_tokenizer()
    for name, quick in (("moe", cfg), ("dense", QuickstartConfig())):
        hf = reference_hf_config(quick.reference, tokenizer)
        hf.save_pretrained(tmp_path / name)
    hf = reference_hf_config(cfg.reference, tokenizer)
    assert (hf.model_type, hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size) == ("qwen3_moe", 6, 2, 96)
    assert engine_routing_flags(cfg, tmp_path / "moe") == ["--enable-return-routed-experts"]
    assert engine_routing_flags(QuickstartConfig(), tmp_path / "dense") == []
    assert cache_key(cfg.reference) != cache_key(QuickstartModelConfig(architecture="qwen3"))
    with pytest.raises(ValidationError, match="moe: architecture 'llama' has no experts"):
        QuickstartModelConfig(moe={"num_experts": 4, "router_topk": 2, "ffn_hidden_size": 8})


def test_the_local_engine_takes_per_expert_pushes_into_transformers_fused_experts(tmp_path):
    """A push names each expert (model.layers.i.mlp.experts.e.gate_proj.weight ...); transformers 5 keeps them fused
    (gate_up_proj [E, 2F, H], down_proj [E, H, F]). The local engine writes each into its slice: the model then
    equals transformers' own loading of the same per-expert checkpoint, bitwise; a bad expert index is refused."""
    from types import SimpleNamespace

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_spo.data.char_tokenizer import build_char_tokenizer
    from megatron_spo.experiments.quickstart import QuickstartConfig
    from megatron_spo.experiments.reference_model import reference_hf_config
    from megatron_spo.rollout.local_engine import LocalEngine

    hf = reference_hf_config(QuickstartConfig.model_validate({"reference": {"architecture": "qwen3_moe"}}).reference,
                             build_char_tokenizer())
    torch.manual_seed(0)
    source, engine = AutoModelForCausalLM.from_config(hf), AutoModelForCausalLM.from_config(hf)
    named = []
    for name, t in source.state_dict().items():
        prefix, _, kind = name.rpartition(".")
        if kind == "gate_up_proj":
            f = t.shape[1] // 2
            for e in range(t.shape[0]):
                named += [(f"{prefix}.{e}.gate_proj.weight", t[e, :f].clone()),
                          (f"{prefix}.{e}.up_proj.weight", t[e, f:].clone())]
        elif kind == "down_proj" and t.ndim == 3:
            named += [(f"{prefix}.{e}.down_proj.weight", t[e].clone()) for e in range(t.shape[0])]
        else:
            named.append((name, t.clone()))
    assert sum(".experts." in n for n, _ in named) == 3 * 6 * 3  # layers x experts x (gate, up, down)
    LocalEngine.load_named_tensors(SimpleNamespace(model=engine), named)
    hf.save_pretrained(tmp_path)
    save_file({n: t.contiguous() for n, t in named if n != "lm_head.weight" or not hf.tie_word_embeddings},
              str(tmp_path / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)  # transformers' own per-expert -> fused loading
    for name, t in reference.state_dict().items():
        assert torch.equal(engine.state_dict()[name], t), name
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.mlp.experts.6.up_proj.weight'"):
        LocalEngine.load_named_tensors(SimpleNamespace(model=engine), [
            ("model.layers.0.mlp.experts.6.up_proj.weight", torch.zeros(96, 128))])
