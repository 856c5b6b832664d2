"""The local engine and its protocol, in one process: SGLang's own schema accepts our request bodies and
decodes our responses; sampling and log-probs are exactly SGLang's semantics on a tiny random Llama;
disk weight updates; the rollout manager's retries, dedup, staleness and backpressure."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rollout_helpers import FaultyServer, ServerThread, make_tiny_llama, perturbed_state_dict  # noqa: E402
from sglang_source import SGLANG_NOT_INSTALLED, sglang_root  # noqa: E402

from megatron_spo.config import ConfigError, build_config  # noqa: E402
from megatron_spo.rollout.client import EngineClient, EngineError, post_json  # noqa: E402
from megatron_spo.rollout.config import RolloutConfig  # noqa: E402
from megatron_spo.rollout.local_engine import LocalEngine, Req  # noqa: E402
from megatron_spo.rollout.manager import Prompt, RolloutManager  # noqa: E402
from megatron_spo.rollout.protocol import (  # noqa: E402
    GenerateRequest,
    ProtocolError,
    SamplingParams,
)
from megatron_spo.rollout.weight_sync import WeightBroadcaster, iter_buckets


# -------------------------------------------------------------------------------------------------
# fixtures
# -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sglang_api():
    """sglang's generated /generate schema (api/v1/api_types.py), loaded by file path with only msgspec."""
    root = sglang_root()  # found without importing sglang (its imports need CUDA)
    if root is None:
        pytest.skip(SGLANG_NOT_INSTALLED)
    spec = importlib.util.spec_from_file_location("sglang_api_types", os.path.join(root, "api", "v1", "api_types.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    torch.set_num_threads(1)
    return LocalEngine(model_dir, seed=0)


@pytest.fixture(scope="module")
def server(engine):
    with ServerThread(engine) as srv:
        yield srv


def run(coro):
    return asyncio.run(coro)


def hf_scores(engine: LocalEngine, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), V] logits of the model at each output position, by one plain forward."""
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) + len(output) - 1]


# -------------------------------------------------------------------------------------------------
# protocol vs SGLang's own definitions
# -------------------------------------------------------------------------------------------------
def test_request_bodies_pass_sglang_schema(sglang_api):
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.95, top_k=20, n=4, stop_token_ids=[2],
                            sampling_seed=3)
    for ids, rid in (([1, 2, 3], "req-1"), ([[1, 2], [3, 4, 5]], None)):
        body = json.loads(json.dumps(GenerateRequest(ids, params, return_logprob=True, rid=rid).to_json()))
        decoded = sglang_api.GenerateRequest.from_json_value(body)
        assert decoded.input_ids == ids and decoded.return_logprob is True and decoded.rid == rid
        sp = decoded.sampling_params
        assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.top_k, sp.n, sp.stop_token_ids,
                sp.sampling_seed) == (16, 0.7, 0.95, 20, 4, [2], 3)
    # SGLang rejects unknown sampling keys; so does our server-side parser, naming the key
    with pytest.raises(sglang_api.JsonContractError, match="unknown field `temprature`"):
        sglang_api.SamplingParams.from_json_value({"temprature": 0.5})
    with pytest.raises(ProtocolError, match=r"unsupported field\(s\) \['temprature'\]"):
        SamplingParams.from_json({"temprature": 0.5})


def test_responses_decode_with_sglang_decoder(server, sglang_api):
    body = GenerateRequest([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=6, temperature=0.8, n=2),
                           return_logprob=True, rid=["a", "b"]).to_json()
    status, items = post_json(server.url + "/generate", body)
    assert status == 200 and isinstance(items, list) and len(items) == 4
    decoded = [sglang_api.GenerateResponse.from_json_value(item) for item in items]
    # n > 1: SGLang gives every sample a fresh id (tokenizer_manager.py _handle_batch_request: regenerate_rid),
    # not the request's rid or rid_i; clients must not match samples by id
    ids = [d.meta_info.id for d in decoded]
    assert len(set(ids)) == 4 and not {"a", "b", "a_0", "a_1", "b_0", "b_1"} & set(ids)
    for d in decoded:
        assert d.meta_info.completion_tokens == len(d.output_ids) == len(d.meta_info.output_token_logprobs)
        assert [e.token_id for e in d.meta_info.output_token_logprobs] == d.output_ids
        assert d.meta_info.weight_version == "default"
        assert isinstance(d.meta_info.finish_reason, (sglang_api.FinishLength, sglang_api.FinishStop))
    for path, cls in (("/model_info", "GetModelInfoResponse"), ("/server_info", "GetServerInfoResponse")):
        info = getattr(sglang_api, cls).from_json_value(json.loads(_get(server.url + path)))
        assert info.model_path == server.engine.model_path


def _get(url):
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read()


@pytest.mark.parametrize("sampling, message", [
    ({"top_p": 0}, "sampling_params.top_p must be in (0, 1], got 0"),
    ({"temperature": -1}, "sampling_params.temperature must be a non-negative finite number, got -1"),
    ({"n": 0}, "sampling_params.n must be an integer >= 1, got 0"),
    ({"top_k": 0}, "sampling_params.top_k must be -1 (disable) or >= 1, got 0"),
    ({"repetition_penalty": 1.2, "min_new_tokens": 0},
     "sampling_params.repetition_penalty=1.2 is not supported by the local engine (only the default 1.0)"),
    ({"max_new_tokens": 1000}, "exceeds the context length 256"),
])
def test_bad_requests_get_400_with_reason(server, sampling, message):
    status, body = post_json(server.url + "/generate", {"input_ids": [3, 4], "sampling_params": sampling})
    assert status == 400 and message in body["error"]["message"]


# -------------------------------------------------------------------------------------------------
# sampling semantics
# -------------------------------------------------------------------------------------------------
def test_logprobs_are_sglang_temperature_scaled_logprobs(engine):
    prompt = [5, 6, 7, 8]
    for temperature in (0.3, 1.0, 1.7):
        [res] = engine.generate([Req(prompt, SamplingParams(max_new_tokens=12, temperature=temperature,
                                                                  top_p=0.9, ignore_eos=True, sampling_seed=1), "x")])
        scores = hf_scores(engine, prompt, res.output_ids)
        expected = torch.log_softmax(scores / temperature, -1).gather(1, torch.tensor(res.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(res.logprobs), expected, atol=2e-5, rtol=0)


def test_greedy_matches_transformers_generate_and_reports_raw_logprobs(engine):
    prompt = [10, 11, 12]
    [res] = engine.generate([Req(prompt, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
                                       "g")])
    ref = engine.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
    assert res.output_ids == ref
    raw = torch.log_softmax(hf_scores(engine, prompt, ref), -1).gather(1, torch.tensor(ref)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(res.logprobs), raw, atol=2e-5, rtol=0)


@pytest.fixture(scope="module")
def deterministic_engine(model_dir):
    return LocalEngine(model_dir, seed=0, deterministic=True)


def test_seeded_rows_do_not_depend_on_batch_company(deterministic_engine):
    engine = deterministic_engine
    params = SamplingParams(max_new_tokens=8, temperature=1.0, sampling_seed=42, ignore_eos=True)
    alone = engine.generate([Req([3, 4, 5, 6, 7], params, "a")])[0]
    batched = engine.generate([Req([9], SamplingParams(max_new_tokens=3), "b"),
                               Req([3, 4, 5, 6, 7], params, "a"),
                               Req([20, 21, 22, 23, 24, 25, 26, 27], SamplingParams(max_new_tokens=8), "c")])[1]
    assert batched.output_ids == alone.output_ids
    torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)


def test_sampling_seed_acts_only_under_deterministic_inference_and_n_samples_share_it(engine, deterministic_engine):
    """SGLang (layers/sampler.py, sampling/sampling_batch_info.py): sampling_seed is used only with
    --enable-deterministic-inference, every sample of a request gets the request's seed and unseeded rows get
    42, so the n samples of one request are identical; without the flag the seed is ignored."""
    def samples(eng, seed, n=3):
        params = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True, sampling_seed=seed)
        return [r.output_ids for r in eng.generate([Req([3, 4, 5], params, f"s{i}") for i in range(n)])]

    same = samples(deterministic_engine, 7)
    assert same[0] == same[1] == same[2]  # n samples of one seeded request: one sample, three times
    assert samples(deterministic_engine, 8)[0] != same[0]  # a seed per sample is what tells them apart
    assert samples(deterministic_engine, None) == samples(deterministic_engine, 42)
    ignored = samples(engine, 7)
    assert len({tuple(o) for o in ignored}) == 3  # no deterministic inference: the seed does nothing


def test_top_k_sampling_follows_the_renormalised_distribution(engine):
    """First-token frequencies over 1200 samples match softmax(logits / T) restricted to the top 3."""
    prompt, temperature = [30, 31, 32], 2.0
    rows = [Req(prompt, SamplingParams(max_new_tokens=1, temperature=temperature, top_k=3, ignore_eos=True,
                                             sampling_seed=s), f"s{s}") for s in range(1200)]
    counts = torch.zeros(engine.vocab_size)
    for res in engine.generate(rows):
        counts[res.output_ids[0]] += 1
    probs = torch.softmax(hf_scores(engine, prompt, [0])[0] / temperature, -1)
    top = probs.topk(3)
    assert set(counts.nonzero()[:, 0].tolist()) <= set(top.indices.tolist())
    expected = top.values / top.values.sum()
    observed = counts[top.indices] / counts.sum()
    assert (observed - expected).abs().max() < 4 * math.sqrt(0.25 / 1200)  # 4 sigma


def test_stop_tokens_and_length_finish_reasons(engine):
    prompt = [5, 6, 7]
    [free] = engine.generate([Req(prompt, SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True),
                                        "f")])
    stop_at = free.output_ids[3]
    first = free.output_ids.index(stop_at)
    [stopped] = engine.generate([Req(prompt, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                  stop_token_ids=[stop_at], ignore_eos=True), "s")])
    assert stopped.output_ids == free.output_ids[:first + 1]  # the matched stop token is included (as SGLang)
    assert stopped.finish == {"type": "stop", "matched": stop_at}
    assert free.finish == {"type": "length", "length": 10}


# -------------------------------------------------------------------------------------------------
# weights from disk
# -------------------------------------------------------------------------------------------------
def test_disk_weight_sync_loads_new_weights_and_version(server, model_dir, tmp_path):
    engine = server.engine
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    new = perturbed_state_dict(model_dir, seed=7)
    try:
        sync = WeightBroadcaster([server.url], mode="disk", disk_dir=str(tmp_path), bucket_bytes=20_000)
        report = sync.push(new.items(), version="5")
        assert report.num_buckets > 1 and report.num_tensors == len(new)
        for name, tensor in engine.model.state_dict().items():
            assert torch.equal(tensor, new[name]), name
        info = json.loads(_get(server.url + "/model_info"))
        assert info["weight_version"] == "5"
        # a bad update names the weight and leaves the model untouched
        status, body = post_json(server.url + "/update_weights_from_disk", {"model_path": str(tmp_path / "nope")})
        assert status == 400 and body["success"] is False and "no *.safetensors" in body["message"]
    finally:
        engine.load_named_tensors(list(before.items()))
        assert post_json(server.url + "/update_weight_version", {"new_version": "default"})[0] == 200


def test_tied_embeddings_accept_both_names(tmp_path):
    """Llama 3.2 1B ties lm_head to the embedding: a state_dict sender sends both names."""
    tied = LocalEngine(make_tiny_llama(str(tmp_path / "tied"), tie=True))
    new = perturbed_state_dict(str(tmp_path / "tied"), seed=3)
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    tied.load_named_tensors(list(new.items()))
    assert torch.equal(tied.model.get_output_embeddings().weight, new["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match=r"weight 'model.norm.weight': shape \(3,\) != model \(32,\)"):
        tied.load_named_tensors([("model.norm.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match="unknown weight name 'model.nope'"):
        tied.load_named_tensors([("model.nope", torch.zeros(3))])


def test_buckets_respect_size_and_alignment():
    tensors = [("a", torch.zeros(3, dtype=torch.uint8)), ("b", torch.zeros(4)), ("c", torch.zeros(100)),
               ("d", torch.zeros(2))]
    buckets = list(iter_buckets(tensors, bucket_bytes=64))
    # 'b' (float32) cannot start at byte 3, 'c' (400 B) exceeds the limit and gets its own bucket
    assert [b.names for b in buckets] == [["a"], ["b"], ["c"], ["d"]]
    bucket = list(iter_buckets([("x", torch.arange(4.0)), ("y", torch.arange(2.0))], 1 << 20))[0]
    assert torch.equal(bucket.flatten().view(torch.float32), torch.tensor([0.0, 1, 2, 3, 0, 1]))
    staging = torch.full((64,), 7, dtype=torch.uint8)
    assert bucket.flatten(staging) is staging  # big enough: reused, not reallocated
    assert torch.equal(staging[:24].view(torch.float32), torch.tensor([0.0, 1, 2, 3, 0, 1]))
    assert bucket.flatten(torch.empty(3, dtype=torch.uint8)).numel() == 24  # too small: grown
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        list(iter_buckets(tensors, 0))


# -------------------------------------------------------------------------------------------------
# rollout manager
# -------------------------------------------------------------------------------------------------
PROMPTS = [Prompt(f"p{i}", [3 + i, 4 + i, 5 + i], problem=i) for i in range(6)]


def length_reward(problem, text: str) -> float:
    return float(len(text))


def test_manager_delivers_every_request_once_with_behaviour_logprobs(server):
    cfg = RolloutConfig(samples_per_prompt=3, max_new_tokens=6, max_inflight_requests=4, buffer_groups=32,
                        temperature_range=(0.1, 0.8), top_p=0.95, seed=1)

    async def reward(problem, text):  # async reward (RewardPool-like)
        await asyncio.sleep(0)
        return length_reward(problem, text)

    async def go():
        manager = RolloutManager(cfg, PROMPTS, reward, endpoints=[server.url])
        await manager.start(max_requests=10)
        await manager.join()
        groups = await manager.get_groups(10, timeout_s=5)
        stats = manager.stats()
        await manager.stop()
        return groups, stats

    groups, stats = run(go())
    ids = [g[0].request_id for g in groups]
    assert len(set(ids)) == 10 and all(len(g) == 3 for g in groups)
    for group in groups:
        assert len({t.temperature for t in group}) == 1 and 0.1 <= group[0].temperature <= 0.8
        for t in group:
            assert t.reward == len(t.text) and t.policy_version == 0 and t.source == "online"
            assert len(t.behaviour_logprobs) == len(t.response_tokens) and all(lp <= 0 for lp in t.behaviour_logprobs)
            record = t.to_record()
            assert set(record) == {"prompt_id", "prompt_tokens", "response_tokens", "reward", "source",
                                   "policy_version", "behaviour_logprobs"}
    assert stats["rollout/groups"] == 10 and stats["rollout/tokens_per_s"] > 0 and stats["rollout/staleness_0"] == 10


def test_manager_timeout_loses_no_group_and_survives_reward_errors(server):
    cfg = RolloutConfig(samples_per_prompt=1, max_new_tokens=2, max_inflight_requests=2)
    prompts = [Prompt("bad", [3, 4], problem="bad"), Prompt("good", [5, 6], problem="good")]

    def reward(problem, text):
        if problem == "bad":
            raise RuntimeError("reward crashed")
        return 1.0

    async def go():
        manager = RolloutManager(cfg, prompts, reward, endpoints=[server.url])
        await manager.start(max_requests=8)
        await manager.join()
        delivered = manager.metrics.groups_delivered
        with pytest.raises(asyncio.TimeoutError):
            await manager.get_groups(delivered + 1, timeout_s=0.3)  # takes them all, then times out
        groups = await manager.get_groups(delivered, timeout_s=1)  # ... and still has them
        await manager.stop()
        return groups, manager.metrics

    groups, metrics = run(go())
    assert metrics.reward_errors + metrics.groups_delivered == 8 and metrics.reward_errors >= 1
    assert len(groups) == metrics.groups_delivered and all(g[0].prompt_id == "good" for g in groups)


def test_manager_backpressure_bounds_requests(server):
    cfg = RolloutConfig(samples_per_prompt=1, max_new_tokens=2, max_inflight_requests=2, buffer_groups=3)

    async def go():
        manager = RolloutManager(cfg, PROMPTS, length_reward, endpoints=[server.url])
        await manager.start()
        await asyncio.sleep(1.5)  # nobody consumes
        issued = manager.metrics.requests
        depth = manager.buffer.qsize()
        await manager.stop()
        return issued, depth

    issued, depth = run(go())
    assert depth == 3 and issued <= 3 + 2  # buffer + one blocked request per worker


@pytest.mark.parametrize("policy", ["drop", "tag"])
def test_manager_staleness_bound(server, policy):
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=2, max_inflight_requests=1, max_staleness=1,
                        stale_policy=policy)

    async def go():
        manager = RolloutManager(cfg, PROMPTS, length_reward, endpoints=[server.url])
        manager.set_policy_version(2)  # the engine still serves version 0 ("default"): lag 2 > 1
        await manager.start(max_requests=3)
        await manager.join()
        groups = [manager.buffer.get_nowait() for _ in range(manager.buffer.qsize())]
        await manager.stop()
        return groups, manager.metrics

    groups, metrics = run(go())
    assert metrics.staleness[2] == 3
    if policy == "drop":
        assert groups == [] and metrics.groups_dropped_stale == 3
    else:
        assert len(groups) == 3 and all(t.stale and t.policy_version == 0 for g in groups for t in g)


def test_manager_routes_around_500s_and_garbage(server):
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=3, max_inflight_requests=2, max_retries=6,
                        retry_backoff_s=0.01, endpoint_max_failures=2, endpoint_cooldown_s=30.0)
    with FaultyServer("error") as err500, FaultyServer("garbage") as garbage:
        async def go():
            manager = RolloutManager(cfg, PROMPTS, length_reward,
                                     endpoints=[server.url, f"http://127.0.0.1:{err500.server.server_port}",
                                                f"http://127.0.0.1:{garbage.server.server_port}"])
            await manager.start(max_requests=12)
            await manager.join()
            groups = await manager.get_groups(12, timeout_s=5)
            await manager.stop()
            return groups, manager.metrics

        groups, metrics = run(go())
    assert len({g[0].request_id for g in groups}) == 12 and metrics.failed_requests == 0
    # each bad endpoint gets at most endpoint_max_failures requests (+1 already in flight) before its cooldown
    assert 1 <= err500.hits <= 3 and 1 <= garbage.hits <= 3
    assert metrics.retries == err500.hits + garbage.hits


def test_manager_times_out_a_hung_engine_and_retries_elsewhere(server):
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=3, max_inflight_requests=2, request_timeout_s=0.5,
                        retry_backoff_s=0.01, endpoint_max_failures=1, endpoint_cooldown_s=30.0)
    with FaultyServer("slow") as slow:
        async def go():
            manager = RolloutManager(cfg, PROMPTS, length_reward,
                                     endpoints=[server.url, f"http://127.0.0.1:{slow.server.server_port}"])
            start = time.monotonic()
            await manager.start(max_requests=8)
            await manager.join()
            elapsed = time.monotonic() - start
            groups = await manager.get_groups(8, timeout_s=5)
            await manager.stop()
            return groups, manager.metrics, elapsed

        groups, metrics, elapsed = run(go())
    assert len({g[0].request_id for g in groups}) == 8 and metrics.failed_requests == 0
    assert 1 <= slow.hits <= 2 and metrics.retries == slow.hits  # then it cools down for 30 s
    assert elapsed < 10  # never waited for the hung engine beyond the 0.5 s timeout


def test_client_raises_engine_error_for_garbage():
    with FaultyServer("garbage") as garbage:
        async def go():
            async with EngineClient(f"http://127.0.0.1:{garbage.server.server_port}") as client:
                await client.generate([[1, 2]], SamplingParams())

        with pytest.raises(EngineError, match="bad response: expected 1 completions|malformed"):
            run(go())


def test_rollout_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="rollout.yaml: temperature_range must satisfy"):
        build_config(RolloutConfig, {"temperature_range": [0.8, 0.1]}, "rollout.yaml")
    with pytest.raises(ConfigError, match="top_p: Input should be less than or equal to 1"):
        build_config(RolloutConfig, {"top_p": 1.5})


def test_cli_errors_name_the_bad_argument(tmp_path, capsys):
    from megatron_spo.rollout import engine_server, fleet

    missing = str(tmp_path / "missing")
    assert fleet.main(["up", "--model", missing, "--engines", "2"]) == 2
    assert f"megatron-spo fleet: model directory '{missing}' does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        engine_server.main(["--model", missing])
    assert exit_info.value.code == 2 and f"--model '{missing}' is not a directory" in capsys.readouterr().err
