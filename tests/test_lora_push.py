"""LoRA adapter pushes (rollout/adapter_push.py, engine_lora.py; issue 46): the engine flags and request bodies held to
SGLang's own parsers, the payload read by SGLang's own deserializer, the local engine serving an adapter as the merged
weights would, versioned names without a window, and bad input refused in one line naming the field."""

import asyncio
import json
import math

import pytest
import torch
from lora_helpers import random_adapters
from rollout_helpers import ServerThread
from trainer_helpers import VOCAB, make_tiny_hf

from megatron_spo.config import ConfigError
from megatron_spo.models.lora import TARGETS, LoraConfig, adapter_key
from megatron_spo.models.peft_export import peft_tensors
from megatron_spo.rollout import adapter_push as ap
from megatron_spo.rollout.client import get_json, post_json
from megatron_spo.rollout.protocol import (
    GenerateRequest,
    LoadLoraAdapterFromTensorsRequest,
    SamplingParams,
    UnloadLoraAdapterRequest,
    UpdateWeightVersionRequest,
)

LORA = LoraConfig(rank=4, alpha=8, rslora=True)  # scaling alpha / sqrt(r) = 4: SGLang is told lora_alpha 16
MODULES = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def megatron_adapters(cfg, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Full adapters keyed as gather_adapters gives them (every layer, every target), random both factors."""
    d = cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    dims = {"linear_qkv": (h, (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d),
            "linear_proj": (cfg.num_attention_heads * d, h), "linear_fc1": (h, 2 * f), "linear_fc2": (f, h)}
    shapes = {}
    for layer in range(cfg.num_layers):
        for target in TARGETS:
            fan_in, fan_out = dims[target]
            shapes[adapter_key(layer, target, "lora_A")] = (rank, fan_in)
            shapes[adapter_key(layer, target, "lora_B")] = (fan_out, rank)
    return random_adapters(shapes, seed)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / "tiny"))


@pytest.fixture(scope="module")
def model_cfg(hf):
    from megatron_spo.models.hf_checkpoint import read_hf_config

    return read_hf_config(hf)


@pytest.fixture(scope="module")
def peft(model_cfg):
    """Two versions' adapters in HF PEFT names, as the trainer pushes them."""
    return [peft_tensors(megatron_adapters(model_cfg, LORA.rank, seed), model_cfg) for seed in (1, 2)]


@pytest.fixture(scope="module")
def engine(hf, model_cfg):
    """A local engine started with LoRA as engine_lora_args says, over HTTP."""
    from megatron_spo.rollout.engine_server import build_parser
    from megatron_spo.rollout.local_engine import LocalEngine

    args = build_parser().parse_args(["--model", hf, *ap.engine_lora_args(LORA, model_cfg)])
    lora = {"max_rank": args.max_lora_rank, "target_modules": args.lora_target_modules}
    with ServerThread(LocalEngine(hf, lora=lora)) as server:
        yield server


def test_engine_flags_are_sglangs_own(hf, model_cfg):
    """SGLang's launcher parses the flags to the LoRA shape the trainer's config has (`serve` takes the same: the
    engine fixture), and the pusher reads that shape back under SGLang's server-arg names."""
    from sglang_source import SGLANG_NOT_INSTALLED, parse_sglang_server_argv, sglang_available

    flags = ap.engine_lora_args(LORA, model_cfg)
    assert flags == ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", *MODULES]
    if not sglang_available():
        pytest.skip(SGLANG_NOT_INSTALLED)
    args = parse_sglang_server_argv(["--model-path", hf, "--tp-size", "2", *flags])
    assert (args.enable_lora, args.max_lora_rank, sorted(args.lora_target_modules)) == (True, 4, MODULES)
    # SGLang's /server_info is its server args by field name: what the pusher reads from it
    info = {k: getattr(args, k) for k in ("enable_lora", "max_lora_rank", "lora_target_modules", "tp_size",
                                          "model_path")}
    assert ap.EngineLoraSettings.from_server_info("u", info) == ap.EngineLoraSettings("u", True, 4, MODULES, 2, hf)


def test_push_bodies_pass_sglangs_io_struct_and_its_deserializer(peft, model_cfg):
    """/load_lora_adapter_from_tensors (TP 2: two payloads), /unload_lora_adapter, /update_weight_version and a
    /generate with lora_path, through SGLang's FastAPI body parse; each rank's payload through the TP worker's own
    path (MultiprocessingSerializer.deserialize -> FlattenedTensorBucket.reconstruct_tensors): the tensors exactly;
    the config through SGLang's target-module normalisation and scaling rule."""
    sglang_source = pytest.importorskip("sglang_source")
    if not sglang_source.sglang_available():
        pytest.skip(sglang_source.SGLANG_NOT_INSTALLED)
    io = sglang_source.io_struct()
    config = ap.push_config_dict(LORA, model_cfg, "/models/base")
    payload = __import__("base64").b64encode(ap.serialize_adapter(peft[0])).decode()
    body = LoadLoraAdapterFromTensorsRequest(lora_name="policy-v1-ab", config_dict=config,
                                             serialized_named_tensors=[payload, payload]).to_json()
    req = sglang_source.parse_http_body(io.LoadLoRAAdapterFromTensorsReqInput, body)
    assert (req.lora_name, req.load_format, req.pinned, req.config_dict) == ("policy-v1-ab", "flattened_bucket",
                                                                            False, config)
    with sglang_source.sglang_imports():
        common = sglang_source.load_module("sglang.srt.utils.common")
        bucket_cls = sglang_source.load_module("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
        for rank_payload in req.serialized_named_tensors:  # bytes after the body parse (Base64Bytes)
            data = common.MultiprocessingSerializer.deserialize(rank_payload)
            tensors = dict(bucket_cls(flattened_tensor=data["flattened_tensor"],
                                      metadata=data["metadata"]).reconstruct_tensors())
            assert list(tensors) == list(peft[0])
            assert all(torch.equal(tensors[k], peft[0][k]) for k in peft[0])
    assert len(peft[0]) == 2 * 7 * model_cfg.num_layers
    # SGLang's LoRAConfig reads r / lora_alpha / target_modules; its adapter scales by lora_alpha / r
    assert config["lora_alpha"] / config["r"] == LORA.scaling == 4.0 and config["use_rslora"] is False
    namespace = {"Union": __import__("typing").Union, "Iterable": __import__("typing").Iterable}
    utils = sglang_source.sglang_root() + "/srt/lora/utils.py"
    normalize = sglang_source.compile_definitions(utils, ["get_normalized_target_modules"],
                                                  namespace)["get_normalized_target_modules"]
    assert normalize(config["target_modules"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert normalize(config["target_modules"]) <= normalize(MODULES)  # the memory pool's can_support
    unload = sglang_source.parse_http_body(io.UnloadLoRAAdapterReqInput, UnloadLoraAdapterRequest("policy-v1-ab")
                                           .to_json())
    assert unload.lora_name == "policy-v1-ab"
    version = sglang_source.parse_http_body(io.UpdateWeightVersionReqInput,
                                            UpdateWeightVersionRequest("1", abort_all_requests=False).to_json())
    assert (version.new_version, version.abort_all_requests) == ("1", False)
    gen = GenerateRequest(input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=2), lora_path="policy-v1-ab")
    assert sglang_source.parse_http_body(io.GenerateReqInput, gen.to_json()).lora_path == "policy-v1-ab"


def _merged_logits(hf, tensors, scaling, ids):
    """transformers' model with W + scaling * B A folded in from the PEFT tensors (independent of engine_lora)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key, a in tensors.items():
            if key.endswith("lora_A.weight"):
                module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                b = tensors[key.replace("lora_A", "lora_B")]
                params[f"{module}.weight"] += scaling * b @ a
        return model(torch.tensor([ids])).logits[0]


def test_an_adapter_push_serves_the_merged_policy_with_an_exact_version(engine, hf, peft, model_cfg):
    """Pushed over HTTP (no pause), the local engine's logits under the adapter are the merged weights' (1e-5), the
    base's without it; the engine reports the pushed version; /generate with its name samples from it."""
    pusher = ap.AdapterPusher([engine.url], ap.push_config_dict(LORA, model_cfg, hf), base_dir=hf)
    report = pusher.push(peft[0], version=1)
    assert report.engines_updated == [engine.url] and not report.failed
    assert report.adapter_bytes == sum(t.numel() * 4 for t in peft[0].values())
    assert ap.adapter_version(report.lora_name) == 1
    ids = [3, 7, 11, 5, 2]
    with torch.no_grad(), engine.engine.lora.active(report.lora_name):
        served = engine.engine.model(torch.tensor([ids])).logits[0]
    with torch.no_grad():
        base = engine.engine.model(torch.tensor([ids])).logits[0]
    merged = _merged_logits(hf, peft[0], LORA.scaling, ids)
    assert (served - merged).abs().max().item() < 1e-5
    assert (served - base).abs().max().item() > 1e-2
    assert get_json(f"{engine.url}/get_weight_version", 10)[1] == {"weight_version": "1"}
    body = GenerateRequest(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=1, temperature=0),
                           return_logprob=True, lora_path=report.lora_name).to_json()
    status, out = post_json(f"{engine.url}/generate", body, 30)
    assert status == 200 and out["output_ids"] == [int(merged[-1].argmax())]
    pusher.retire()
    pusher.close()


def test_versioned_names_leave_no_window_and_retire_after_their_requests(engine, hf, peft, model_cfg):
    """v2 loads beside v1; after the switch v1 is unloaded, but only once the request running on it has finished
    (all its tokens, not aborted); a request naming v1 afterwards is refused with SGLang's text."""
    from megatron_spo.rollout.client import EngineClient

    pusher = ap.AdapterPusher([engine.url], ap.push_config_dict(LORA, model_cfg, hf), base_dir=hf)
    first = pusher.push(peft[0], version=1)
    second = pusher.push(peft[1], version=2)
    assert {first.lora_name, second.lora_name} <= set(engine.engine.lora.adapters)

    async def run_while_retiring():
        client = EngineClient(engine.url)
        params = SamplingParams(max_new_tokens=48, temperature=1.0, ignore_eos=True)
        running = asyncio.create_task(client.generate([[1, 2, 3]], params, lora_path=first.lora_name))
        await asyncio.sleep(0.05)
        retired = await asyncio.get_running_loop().run_in_executor(None, pusher.retire)
        completions = await running
        await client.close()
        return completions[0][0], retired

    completion, retired = asyncio.run(run_while_retiring())
    assert completion.finish_reason == "length" and len(completion.output_ids) == 48
    assert first.lora_name in retired[engine.url]
    assert list(engine.engine.lora.adapters) == [second.lora_name]
    body = GenerateRequest(input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=2),
                           lora_path=first.lora_name).to_json()
    status, out = post_json(f"{engine.url}/generate", body, 30)
    assert status == 400 and out["error"]["message"].startswith(
        f"The following requested LoRA adapters are not loaded: {first.lora_name}")
    assert get_json(f"{engine.url}/get_weight_version", 10)[1] == {"weight_version": "2"}
    pusher.close()


def test_bad_input_is_one_line_naming_the_field(engine, hf, tmp_path, model_cfg, peft, monkeypatch):
    """A rank above the engines' --max-lora-rank, a target they were not started with, an adapter of another base,
    engines without LoRA under lora.push=adapter, a target the family's layers lack; and the engine's own refusals
    (SGLang's text) of a rank it cannot hold and of tensors that do not fit its base."""
    info = get_json(f"{engine.url}/server_info", 10)[1]
    served = ap.EngineLoraSettings.from_server_info(engine.url, info)
    assert (served.enabled, served.max_rank, served.target_modules) == (True, 4, MODULES)
    errors = {}
    for key, lora, eng, base in (
            ("rank", LoraConfig(rank=8), served, None),
            ("targets", LORA, ap.EngineLoraSettings(engine.url, True, 4, ["q_proj", "v_proj"], 1, hf), None),
            ("base", LORA, served, ap.hf_dims(make_tiny_hf(str(tmp_path / "other"), num_layers=3))),
            ("off", LORA, ap.EngineLoraSettings(engine.url, False, None, None, 1, hf), None)):
        with pytest.raises(ap.AdapterPushError) as err:
            ap.check_engine(eng, ap.push_config_dict(lora, model_cfg), base)
        errors[key] = str(err.value)
    assert errors["rank"] == (f"lora.rank: 8 is larger than --max-lora-rank 4 of {engine.url}; start the engines with "
                              "--max-lora-rank 8 or lower lora.rank")
    # SGLang serves q/k/v as one qkv_proj (and gate/up as gate_up_proj): q_proj there covers k_proj
    assert errors["targets"].startswith("lora.targets: down_proj, gate_proj, o_proj, up_proj not among "
                                        "--lora-target-modules q_proj v_proj of ")
    assert errors["base"] == (f"init.hf: the adapters are of another base than {engine.url} serves ({hf}): "
                              "num_hidden_layers 3 vs 2")
    assert errors["off"].startswith(f"lora.push: {engine.url} was not started with --enable-lora")
    assert all("\n" not in e for e in errors.values())

    from megatron_spo.models import hf_map

    rules = hf_map.layer_rules(model_cfg)
    monkeypatch.setattr(hf_map, "layer_rules", lambda cfg: tuple(r for r in rules if "linear_fc1" not in r.megatron))
    with pytest.raises(ConfigError) as err:
        ap.engine_lora_args(LORA, model_cfg)
    assert str(err.value).startswith("lora.targets: linear_fc1 is not a linear of this model's layers (family ")
    monkeypatch.undo()

    config = ap.push_config_dict(LORA, model_cfg)
    payload = __import__("base64").b64encode(ap.serialize_adapter(peft[0])).decode()
    refusals = {}
    for key, cfg, tensors in (("rank", {**config, "r": 8}, peft[0]),
                              ("shape", config, {k: torch.zeros(4, 7) if "lora_A" in k else v
                                                 for k, v in peft[0].items()})):
        body = LoadLoraAdapterFromTensorsRequest(
            lora_name=f"bad-{key}", config_dict=cfg,
            serialized_named_tensors=[payload if tensors is peft[0] else
                                      __import__("base64").b64encode(ap.serialize_adapter(tensors)).decode()]).to_json()
        status, reply = post_json(f"{engine.url}/load_lora_adapter_from_tensors", body, 30)
        assert status == 400 and reply["success"] is False
        refusals[key] = reply["error_message"]
    assert refusals["rank"].startswith("LoRA adapter bad-rank with rank 8 is incompatible with the current LoRA memory "
                                       "pool configuration.")
    assert refusals["shape"] == ("LoRA adapter bad-shape: model.layers.0.mlp.down_proj.lora_A has shape [4, 7], this "
                                 "model's model.layers.0.mlp.down_proj takes [4, 64] (an adapter of another base, or a "
                                 "rank that is not config_dict's r)")
    assert not any(n.startswith("bad-") for n in engine.engine.lora.adapters)


def test_the_local_engine_payload_reader_refuses_other_globals():
    """deserialize_adapter reads only tensor data: a payload naming any other callable is refused."""
    import pickle

    with pytest.raises(pickle.UnpicklingError, match=r"^blocked global posix\.system in an adapter payload$"):
        ap.deserialize_adapter(pickle.dumps({"x": __import__("os").system}), None)
    assert json.dumps(ap.adapter_name(3, "ab")) == '"policy-v3-ab"' and ap.adapter_version("policy-v3-ab") == 3
    assert VOCAB > 11  # the ids the tests above send


def test_rollouts_select_the_adapter_and_carry_its_version_exactly(engine, hf, peft, model_cfg):
    """The manager sends lora_path = the adapter it was switched to; each sample's policy_version is that adapter's
    (one version, not mixed) although the engine's weight_version has moved on to a newer push; the behaviour
    log-probs are the adapter's, not the base's."""
    from megatron_spo.rollout.config import RolloutConfig
    from megatron_spo.rollout.manager import Prompt, RolloutManager

    pusher = ap.AdapterPusher([engine.url], ap.push_config_dict(LORA, model_cfg, hf), base_dir=hf)
    five = pusher.push(peft[0], version=5)
    pusher.push(peft[1], version=6)  # loaded and the engine at weight_version 6; rollouts not switched to it
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=4, max_inflight_requests=1, max_staleness=8)

    async def go():
        manager = RolloutManager(cfg, [Prompt("p", [3, 4, 5], problem=0)], lambda problem, text: 0.0,
                                 endpoints=[engine.url])
        manager.set_policy_version(5, lora_path=five.lora_name)
        await manager.start(max_requests=1)
        await manager.join()
        group = manager.buffer.get_nowait()
        await manager.stop()
        return group

    group = asyncio.run(go())
    assert [(t.policy_version, t.mixed_versions, t.weight_versions) for t in group] == [
        (5, False, [("5", 0, len(t.response_tokens))]) for t in group]
    t = group[0]
    ids = torch.tensor([t.prompt_tokens + t.response_tokens])
    with torch.no_grad():
        with engine.engine.lora.active(five.lora_name):
            adapter = engine.engine.model(ids).logits[0].float()
        base = engine.engine.model(ids).logits[0].float()
    positions = range(len(t.prompt_tokens) - 1, ids.shape[1] - 1)

    def logprobs(logits):
        return [torch.log_softmax(logits[p] / t.temperature, -1)[ids[0, p + 1]].item() for p in positions]

    assert max(abs(a - b) for a, b in zip(logprobs(adapter), t.behaviour_logprobs)) < 1e-4
    assert max(abs(a - b) for a, b in zip(logprobs(base), t.behaviour_logprobs)) > 1e-3
    pusher.retire()
    pusher.close()


def test_the_trainers_online_source_decides_the_push_and_switches_rollouts(engine, hf, peft, model_cfg, monkeypatch):
    """OnlineSource (the trainer's rank 0): lora.push=auto picks adapter pushes for engines started with LoRA and
    merged pushes for engines without (lora.push=adapter then stops in one line); push_adapter loads, switches the
    manager to the new adapter with its version, then retires the previous one. A push that reaches no engine
    switches nothing and retires nothing, and keeps its one-line error for the rollout-wait message."""
    from types import SimpleNamespace

    from megatron_spo.rollout.local_engine import LocalEngine
    from megatron_spo.training.online import OnlineSource

    class Manager:
        cfg, metrics, endpoints = SimpleNamespace(engine_wait_s=30.0), SimpleNamespace(generated_tokens=0), []

        def __init__(self):
            self.switched = []

        async def start(self):
            pass

        async def stop(self):
            pass

        def set_policy_version(self, version, lora_path=None):
            self.switched.append((version, lora_path))

    def source(url):
        s = OnlineSource(Manager(), q0=None)
        s.broadcaster = SimpleNamespace(engine_urls=[url])
        return s

    auto = LoraConfig(rank=4, alpha=8, rslora=True)
    with ServerThread(LocalEngine(hf)) as plain:
        s = source(plain.url)
        assert s.push_mode(auto, model_cfg, hf) == "merged"
        with pytest.raises(ap.AdapterPushError, match=rf"^lora.push: {plain.url} was not started with --enable-lora"):
            s.push_mode(LoraConfig(rank=4, push="adapter"), model_cfg, hf)
        s.close()
    s = source(engine.url)
    assert s.push_mode(auto, model_cfg, hf) == "adapter"
    first = s.push_adapter(7, peft[0])
    name7 = s.lora_path
    second = s.push_adapter(8, peft[1])
    assert s.manager.switched == [(7, name7), (8, s.lora_path)] and ap.adapter_version(s.lora_path) == 8
    assert first["weight_sync/engines_updated"] == second["weight_sync/engines_updated"] == 1.0
    assert first["weight_sync/pause_seconds"] == 0.0 and first["weight_sync/bytes"] > first["weight_sync/adapter_bytes"]
    assert name7 not in engine.engine.lora.adapters and s.lora_path in engine.engine.lora.adapters
    name8, held = s.lora_path, set(engine.engine.lora.adapters)
    monkeypatch.setattr(ap, "post_json_bytes", lambda *a, **k: (500, {"success": False, "error_message": "out of memory"}))
    third = s.push_adapter(9, peft[0])
    assert third["weight_sync/engines_updated"] == 0.0
    assert s.manager.switched == [(7, name7), (8, name8)] and s.lora_path == name8  # rollouts stay on version 8
    assert s.last_sync_error == (f"adapter push reached no engine: {{'{engine.url}': "
                                 "'/load_lora_adapter_from_tensors: HTTP 500: out of memory'}")
    assert set(engine.engine.lora.adapters) == held  # version 8 still served: nothing was retired
    s.close()


def test_a_base_sample_spanning_the_first_adapter_switch_is_version_0_not_mixed():
    """With adapter pushes the base never changes: a request sent before the first switch (no lora_path) is the
    base's, version 0, exactly, though the engine reports its tokens spanning weight versions default -> 9."""
    from megatron_spo.rollout.config import RolloutConfig
    from megatron_spo.rollout.manager import Prompt, RolloutManager
    from megatron_spo.rollout.protocol import Completion

    cfg = RolloutConfig(samples_per_prompt=1, max_new_tokens=4, max_inflight_requests=1, max_staleness=20)
    sent = []

    async def go():
        manager = RolloutManager(cfg, [Prompt("p", [3, 4, 5], problem=0)], lambda problem, text: 0.0,
                                 endpoints=["http://127.0.0.1:9"], check_versions=False)

        async def generate(prompts, params, *, lora_path=None, **kw):
            sent.append(lora_path)
            manager.set_policy_version(9, lora_path="policy-v9-ab")  # the first adapter push lands meanwhile
            return [[Completion(rid="r", output_ids=[1, 2, 3, 4], text="", finish_reason="length", prompt_tokens=3,
                                completion_tokens=4, weight_version="9", logprobs=[-1.0] * 4,
                                weight_versions=[("default", 0, 2), ("9", 2, 4)])]]

        manager.endpoints[0].client.generate = generate
        await manager.start(max_requests=1)
        await manager.join()
        group = manager.buffer.get_nowait()
        await manager.stop()
        return group

    [t] = asyncio.run(go())
    assert sent == [None] and (t.policy_version, t.mixed_versions, t.weight_versions) == (0, False, [("0", 0, 4)])


def test_the_push_order_through_sglangs_own_lora_control_flow(peft, model_cfg):
    """SGLang's TokenizerControlMixin.load_lora_adapter_from_tensors / unload_lora_adapter with its LoRARegistry,
    the backend replaced by its TP workers' deserialization of each rank's payload (TP 2): v1 and v2 load side by
    side; unloading v1 refuses new requests for it at once but completes only when the request holding it ends."""
    sgl = pytest.importorskip("sglang_source")
    if not sgl.sglang_available():
        pytest.skip(sgl.SGLANG_NOT_INSTALLED)
    rc = sgl.runtime_context()
    config = ap.push_config_dict(LORA, model_cfg)
    payload = __import__("base64").b64encode(ap.serialize_adapter(peft[0])).decode()
    with sgl.sglang_imports(), rc.get_context().override_server_args(), \
            rc.get_lora().override(enable_lora=True, max_loaded_loras=None), rc.get_parallel().override(dp_size=1):
        mixin = sgl.load_module("sglang.srt.managers.tokenizer_control_mixin").TokenizerControlMixin
        registry_cls = sgl.load_module("sglang.srt.lora.lora_registry").LoRARegistry
        common = sgl.load_module("sglang.srt.utils.common")
        bucket_cls = sgl.load_module("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
        io = sgl.io_struct()
        events, backend = [], {}

        async def communicator(obj):  # the TP workers: each rank deserializes its own payload (tp_worker.py)
            if isinstance(obj, io.LoadLoRAAdapterFromTensorsReqInput):
                if obj.lora_name in backend:  # LoRAManager.validate_new_adapter
                    return [io.LoRAUpdateOutput(success=False, error_message=f"Failed to load LoRA adapter "
                                                f"{obj.lora_name} because it is already loaded")] * 2
                for rank in range(2):
                    data = common.MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[rank])
                    tensors = dict(bucket_cls(flattened_tensor=data["flattened_tensor"],
                                              metadata=data["metadata"]).reconstruct_tensors())
                    assert all(torch.equal(tensors[k], peft[0][k]) for k in peft[0])
                backend[obj.lora_name] = obj.lora_id
            else:
                backend.pop(obj.lora_name)
            events.append((type(obj).__name__, obj.lora_name))
            return [io.LoRAUpdateOutput(success=True, loaded_adapters=dict.fromkeys(backend, "__tensor__"))] * 2

        shell = type("Shell", (), {n: getattr(mixin, n) for n in (
            "load_lora_adapter_from_tensors", "unload_lora_adapter", "_unload_lora_adapter_locked")})()
        shell.auto_create_handle_loop = lambda: None
        shell.update_lora_adapter_communicator = communicator

        def body(name):
            return sgl.parse_http_body(io.LoadLoRAAdapterFromTensorsReqInput, LoadLoraAdapterFromTensorsRequest(
                lora_name=name, config_dict=config, serialized_named_tensors=[payload, payload]).to_json())

        async def go():
            shell.lora_update_lock, shell.pending_lora_unloads, shell.lora_ref_cache = asyncio.Lock(), {}, {}
            shell.lora_registry = registry = registry_cls()
            v1 = await shell.load_lora_adapter_from_tensors(body("policy-v1-a"))
            held = await registry.acquire("policy-v1-a")  # a request sampling from v1
            again = await shell.load_lora_adapter_from_tensors(body("policy-v1-a"))
            v2 = await shell.load_lora_adapter_from_tensors(body("policy-v2-b"))
            unload = asyncio.create_task(shell.unload_lora_adapter(sgl.parse_http_body(
                io.UnloadLoRAAdapterReqInput, UnloadLoraAdapterRequest("policy-v1-a").to_json())))
            await asyncio.sleep(0.05)
            with pytest.raises(ValueError, match="^The following requested LoRA adapters are not loaded: policy-v1-a"):
                await registry.acquire("policy-v1-a")
            assert not unload.done() and await registry.acquire("policy-v2-b")  # v2 serves throughout
            events.append(("request on v1 ends", None))
            await registry.release(held)
            return v1, again, v2, await unload

        v1, again, v2, unloaded = asyncio.run(go())
    assert v1.success and v2.success and unloaded.success
    assert not again.success and again.error_message.endswith("policy-v1-a because it is already loaded")
    assert events == [("LoadLoRAAdapterFromTensorsReqInput", "policy-v1-a"),
                      ("LoadLoRAAdapterFromTensorsReqInput", "policy-v2-b"), ("request on v1 ends", None),
                      ("UnloadLoRAAdapterReqInput", "policy-v1-a")]


# ---------------------------------------------------------------------------------------------
# Adapter pushes by path (lora.transport=path): written once to a shared directory, /load_lora_adapter
# ---------------------------------------------------------------------------------------------
PATH_FILES = ["adapter_config.json", "adapter_model.safetensors", "digests.json"]


def test_a_path_push_body_and_directory_pass_sglangs_own_code(peft, model_cfg, tmp_path):
    """The pushed directory through SGLang's LoRAConfig (what its LoRAManager reads from lora_path) and the
    /load_lora_adapter body through its FastAPI parse into LoadLoRAAdapterReqInput, then its TokenizerControlMixin
    load_lora_adapter / unload_lora_adapter with its LoRARegistry (the backend: LoRAConfig on obj.lora_path, the
    weights read back): v1 and v2 side by side, v1 unloaded after."""
    sgl = pytest.importorskip("sglang_source")
    if not sgl.sglang_available():
        pytest.skip(sgl.SGLANG_NOT_INSTALLED)
    from safetensors.torch import load_file

    from megatron_spo.models.peft_export import write_peft_dir
    from megatron_spo.rollout.protocol import LoadLoraAdapterRequest

    config = ap.push_config_dict(LORA, model_cfg, "/models/base")
    dirs = {v: write_peft_dir(tmp_path / f"policy-v{v}-ab", peft[v - 1], config) for v in (1, 2)}
    assert sorted(p.name for p in dirs[1].iterdir()) == PATH_FILES  # one *.safetensors: DefaultModelLoader's glob
    assert not list(tmp_path.glob("*.partial"))
    namespace = {"json": json, "os": __import__("os"), "Dict": dict, "Optional": __import__("typing").Optional,
                 "logger": __import__("logging").getLogger("sglang-lora"),
                 "snapshot_download": lambda *a, **k: pytest.fail("a shared directory is read, not downloaded")}
    lora_config = sgl.compile_definitions(sgl.sglang_root() + "/srt/lora/lora_config.py", ["LoRAConfig"],
                                          namespace)["LoRAConfig"]
    read = lora_config(str(dirs[1]), base_vocab_size=VOCAB)
    assert (read.r, read.lora_alpha, read.target_modules, read.use_dora, read.lora_added_tokens_size) == (
        4, 16.0, MODULES, False, 0)
    assert read.hf_config == config
    io = sgl.io_struct()
    req = sgl.parse_http_body(io.LoadLoRAAdapterReqInput,
                              LoadLoraAdapterRequest(lora_name="policy-v1-ab", lora_path=str(dirs[1])).to_json())
    assert (req.lora_name, req.lora_path, req.pinned, req.lora_id) == ("policy-v1-ab", str(dirs[1]), False, None)

    rc = sgl.runtime_context()
    with sgl.sglang_imports(), rc.get_context().override_server_args(), \
            rc.get_lora().override(enable_lora=True, max_loaded_loras=None), rc.get_parallel().override(dp_size=1):
        mixin = sgl.load_module("sglang.srt.managers.tokenizer_control_mixin").TokenizerControlMixin
        registry_cls = sgl.load_module("sglang.srt.lora.lora_registry").LoRARegistry
        events, backend = [], {}

        async def communicator(obj):  # each TP worker: LoRAConfig(lora_path) + the directory's weights
            if isinstance(obj, io.LoadLoRAAdapterReqInput):
                for _rank in range(2):
                    assert lora_config(obj.lora_path).r == 4
                    tensors = load_file(f"{obj.lora_path}/adapter_model.safetensors")
                    version = int(obj.lora_name[len("policy-v")])
                    assert all(torch.equal(tensors[k], peft[version - 1][k]) for k in peft[0])
                backend[obj.lora_name] = obj.lora_path
            else:
                backend.pop(obj.lora_name)
            events.append((type(obj).__name__, obj.lora_name))
            return [io.LoRAUpdateOutput(success=True, loaded_adapters=dict(backend))] * 2

        shell = type("Shell", (), {n: getattr(mixin, n) for n in (
            "load_lora_adapter", "unload_lora_adapter", "_unload_lora_adapter_locked")})()
        shell.auto_create_handle_loop = lambda: None
        shell.update_lora_adapter_communicator = communicator

        async def go():
            shell.lora_update_lock, shell.pending_lora_unloads, shell.lora_ref_cache = asyncio.Lock(), {}, {}
            shell.lora_registry = registry = registry_cls()
            out = []
            for v in (1, 2):
                out.append(await shell.load_lora_adapter(sgl.parse_http_body(io.LoadLoRAAdapterReqInput,
                           LoadLoraAdapterRequest(lora_name=f"policy-v{v}-ab", lora_path=str(dirs[v])).to_json())))
            assert await registry.acquire("policy-v2-ab")
            out.append(await shell.unload_lora_adapter(sgl.parse_http_body(
                io.UnloadLoRAAdapterReqInput, UnloadLoraAdapterRequest("policy-v1-ab").to_json())))
            return out

        v1, v2, unloaded = asyncio.run(go())
    assert v1.success and v2.success and unloaded.success
    assert v2.loaded_adapters == {"policy-v1-ab": str(dirs[1]), "policy-v2-ab": str(dirs[2])}
    assert events == [("LoadLoRAAdapterReqInput", "policy-v1-ab"), ("LoadLoRAAdapterReqInput", "policy-v2-ab"),
                      ("UnloadLoRAAdapterReqInput", "policy-v1-ab")]


def test_a_path_push_serves_what_a_tensor_push_serves_and_cleans_up(engine, hf, peft, model_cfg, tmp_path):
    """By path the local engine serves exactly the logits the tensor push gives (same tensors, bitwise), rank 0
    sends a few hundred bytes of JSON instead of the base64 adapter, the engine reports the adapter's path, and a
    push directory goes when its adapter is unloaded (the newest stays, no .partial left)."""
    config = ap.push_config_dict(LORA, model_cfg, hf)
    push_dir = tmp_path / "lora_push"
    by_path = ap.AdapterPusher([engine.url], config, base_dir=hf, push_dir=str(push_dir))
    one = by_path.push(peft[0], version=1)
    assert one.transport == "path" and one.engines_updated == [engine.url] and not one.failed
    path = push_dir / one.lora_name
    assert sorted(p.name for p in path.iterdir()) == PATH_FILES
    assert one.bytes_written == sum(p.stat().st_size for p in path.iterdir())
    assert one.bytes_written > one.adapter_bytes == sum(t.numel() * 4 for t in peft[0].values())
    assert one.bytes_sent == len(json.dumps({"lora_name": one.lora_name, "lora_path": str(path), "pinned": False}))
    assert one.metrics()["weight_sync/bytes_written"] == float(one.bytes_written)
    assert get_json(f"{engine.url}/get_weight_version", 10)[1] == {"weight_version": "1"}

    tensors = ap.AdapterPusher([engine.url], config, base_dir=hf)
    same = tensors.push(peft[0], version=1)
    assert same.transport == "tensors" and same.bytes_written == 0 and same.bytes_sent > 100 * one.bytes_sent
    ids = torch.tensor([[3, 7, 11, 5, 2]])
    with torch.no_grad():
        with engine.engine.lora.active(one.lora_name):
            from_path = engine.engine.model(ids).logits
        with engine.engine.lora.active(same.lora_name):
            from_tensors = engine.engine.model(ids).logits
    assert torch.equal(from_path, from_tensors)
    two = by_path.push(peft[1], version=2)
    status, reply = post_json(f"{engine.url}/unload_lora_adapter", UnloadLoraAdapterRequest("none").to_json(), 30)
    assert status == 400 and {one.lora_name: str(path), same.lora_name: "__tensor__",  # + earlier tests' adapters
                              two.lora_name: str(push_dir / two.lora_name)}.items() <= reply["loaded_adapters"].items()
    retired = by_path.retire()  # every older policy adapter the engine reported, the tensor-pushed one too
    assert {one.lora_name, same.lora_name} <= set(retired[engine.url]) and two.lora_name not in retired[engine.url]
    assert list(engine.engine.lora.adapters) == [two.lora_name]
    assert sorted(p.name for p in push_dir.iterdir()) == [two.lora_name]  # v1's directory went with its adapter
    by_path.push(peft[0], version=3)
    by_path.retire()
    assert [p.name for p in push_dir.iterdir()] == [by_path.current]
    by_path.retire()
    by_path.close()
    tensors.close()


def test_path_push_errors_name_the_field(engine, hf, peft, model_cfg, tmp_path):
    """A push directory rank 0 cannot write stops at the probe naming lora.push_dir; an engine that cannot read the
    path refuses it (the pusher's error names lora.push_dir); a corrupted file is refused by its digest; the trainer's
    lora.transport=path defaults the directory to <run_dir>/lora_push."""
    from types import SimpleNamespace

    from megatron_spo.models.peft_export import write_peft_dir
    from megatron_spo.rollout.protocol import LoadLoraAdapterRequest
    from megatron_spo.training.online import OnlineSource

    config = ap.push_config_dict(LORA, model_cfg, hf)
    (tmp_path / "file").write_text("")
    with pytest.raises(ap.AdapterPushError) as err:
        ap.AdapterPusher([engine.url], config, push_dir=str(tmp_path / "file" / "push")).probe()
    assert str(err.value) == (f"lora.push_dir: cannot write {tmp_path}/file/push (Not a directory); name a directory "
                              "the trainer can write and every engine can read")
    status, reply = post_json(f"{engine.url}/load_lora_adapter",
                              LoadLoraAdapterRequest("bad-path", str(tmp_path / "elsewhere")).to_json(), 30)
    assert status == 400 and reply["error_message"] == (
        f"LoRA adapter path {tmp_path}/elsewhere is not a directory with adapter_config.json (is it on a filesystem "
        "this engine shares with the trainer?)")
    pusher = ap.AdapterPusher([engine.url], config, push_dir=str(tmp_path / "push"))
    pusher.probe()
    with pytest.MonkeyPatch.context() as mp:  # the engine sees another filesystem: the written path is not there
        mp.setattr(ap, "LoadLoraAdapterRequest",
                   lambda lora_name, lora_path: LoadLoraAdapterRequest(lora_name, lora_path + "-elsewhere"))
        report = pusher.push(peft[0], version=4)
    assert report.engines_updated == [] and report.failed[engine.url].startswith("/load_lora_adapter: HTTP 400: ")
    assert report.failed[engine.url].endswith(f"(lora.push_dir: every engine must read {tmp_path}/push)")
    pusher.close()
    bad = write_peft_dir(tmp_path / "bad", peft[0], config)
    data = bytearray((bad / "adapter_model.safetensors").read_bytes())
    data[-1] ^= 1
    (bad / "adapter_model.safetensors").write_bytes(bytes(data))
    status, reply = post_json(f"{engine.url}/load_lora_adapter", LoadLoraAdapterRequest("bad-crc", str(bad)).to_json(),
                              30)
    assert status == 400 and "adapter_model.safetensors" in reply["error_message"] and "\n" not in reply[
        "error_message"]
    assert not any(n.startswith("bad-") for n in engine.engine.lora.adapters)

    class Manager:
        cfg = SimpleNamespace(engine_wait_s=30.0)

        async def start(self):
            pass

        async def stop(self):
            pass

    s = OnlineSource(Manager(), q0=None)
    s.broadcaster, s._fleet_seen_healthy = SimpleNamespace(engine_urls=[engine.url]), True
    assert s.push_mode(LoraConfig(rank=4, alpha=8, rslora=True, transport="path"), model_cfg, hf,
                       run_dir=str(tmp_path / "run")) == "adapter"
    assert s.adapter_pusher.push_dir == str(tmp_path / "run" / "lora_push")
    s.close()
    with pytest.raises(ValueError, match="transport"):
        LoraConfig(transport="nfs")


def test_plan_prices_a_path_push_beside_the_tensor_push():
    """plan lora_rank=16 at 8B on 64 engine GPUs: by path rank 0 writes the bf16 adapter once (84 MB) and sends
    128 B of JSON per engine GPU, against 7.16 GB of base64 copies; each engine GPU reads the file."""
    from megatron_spo.planning import capacity
    from megatron_spo.planning.config import CapacityConfig

    model, parallel = capacity.load_preset("llama3.1-8b")
    shape = CapacityConfig(lora_rank=16)
    h, f, q, kv, r = 4096, 14336, 4096, 1024, 16
    adapter = 2 * 32 * r * (3 * h + q + 2 * h + f + q + 2 * kv + h + 2 * f + h)
    assert adapter == 83_886_080
    path = capacity.make_plan(model, parallel, shape)["weight_sync"]["by_path"]
    assert path == {"bytes_written": adapter, "bytes_read": 64 * adapter, "http_bytes": 64 * 128,
                    "rank0_bytes": adapter + 64 * 128, "seconds": pytest.approx(0.010 + 2 * adapter / (0.9 * 50e9))}
    tensors = capacity.weight_sync(model, shape)
    assert tensors.bytes == 64 * 4 * math.ceil(adapter / 3) == 7_158_278_912
    assert round(tensors.bytes / path["rank0_bytes"], 1) == 85.3
    assert "by_path" not in capacity.make_plan(model, parallel, CapacityConfig())["weight_sync"]


def test_the_slurm_job_starts_its_engines_with_the_lora_flags(hf, tmp_path):
    """slurm/spo.sbatch with a LoRA config (scontrol and srun stand-ins that record the commands): ENGINE_CMD carries
    --enable-lora --max-lora-rank --lora-target-modules and TRAIN_CMD lora.transport=path; without LoRA neither."""
    from slurm_helpers import job_commands

    commands = {}
    for name, text in (("lora", "lora:\n  rank: 4\n"), ("full", "steps: 3\n")):
        (tmp_path / f"{name}.yaml").write_text(text)
        job = job_commands(tmp_path, MODE="cpu", CONFIG=str(tmp_path / f"{name}.yaml"), SPO_TRAIN_ARGS=f"init.hf={hf}")
        commands[name] = (job["engine"], job["train"])
    engine_cmd, train_cmd = commands["lora"]
    assert engine_cmd.endswith('--port "$ENGINE_PORT" --enable-lora --max-lora-rank 4 --lora-target-modules '
                               + " ".join(MODULES))
    assert train_cmd.endswith(f"init.hf={hf} lora.transport=path")
    assert "lora" not in commands["full"][0] + commands["full"][1]
    from megatron_spo.training.slurm_args import slurm_lora_launch

    assert slurm_lora_launch(__import__("types").SimpleNamespace(
        lora=LoraConfig(rank=4, transport="tensors"), model=model_cfg_of(hf), init=None)) == (
        ["--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", *MODULES], [])


def model_cfg_of(hf):
    from megatron_spo.models.hf_checkpoint import read_hf_config

    return read_hf_config(hf)
