"""The project's messages run through SGLang 0.5.23's own code (tests/sglang_source.py loads it on CPU).

Each test names the SGLang file it exercises (paths under the installed ``sglang`` package). Bodies are
not written by hand here: they are recorded from the project's own client code (rollout manager, Q0 / eval
tools, weight broadcaster) talking to the local engine, then handed to SGLang's parsers and checks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import random
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import sglang_source as sgl  # noqa: E402
from rollout_helpers import (  # noqa: E402
    ServerExited,
    ServerThread,
    engine_env,
    make_tiny_llama,
    perturbed_state_dict,
    start_on_free_port,
)

from megatron_spo.engine_tools.config import ToolSamplingConfig  # noqa: E402
from megatron_spo.rollout import client as client_module  # noqa: E402
from megatron_spo.rollout import weight_sync  # noqa: E402
from megatron_spo.rollout.config import RolloutConfig  # noqa: E402
from megatron_spo.rollout.local_engine import LocalEngine, Req  # noqa: E402
from megatron_spo.rollout.manager import Prompt, RolloutManager  # noqa: E402
from megatron_spo.rollout.protocol import SAMPLING_EPS, TOP_K_ALL, ProtocolError, SamplingParams  # noqa: E402
from megatron_spo.rollout.rwlock import RWLock  # noqa: E402
from megatron_spo.rollout.weight_sync import Bucket, WeightBroadcaster, iter_buckets

if not sgl.sglang_available():
    pytest.skip(sgl.SGLANG_NOT_INSTALLED, allow_module_level=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def io():
    return sgl.io_struct()


@pytest.fixture(scope="module")
def server(model_dir):
    torch.set_num_threads(1)
    with ServerThread(LocalEngine(model_dir, seed=0)) as srv:
        yield srv


# -------------------------------------------------------------------------------------------------
# /generate
# -------------------------------------------------------------------------------------------------
def recorded_generate_bodies(server, monkeypatch) -> list[dict]:
    """Every /generate body the project's clients send: the rollout manager (random temperatures, top-k on
    and off), the Q0/eval tools' sampler (seeded one-per-sample, unseeded n per request, greedy)."""
    from megatron_spo.engine_tools.sampling import sample

    bodies = []
    original = client_module.EngineClient.request

    async def recording(self, method, path, body=None, timeout_s=None, headers=None):
        if path == "/generate":
            bodies.append(json.loads(json.dumps(body)))
        return await original(self, method, path, body, timeout_s, headers)

    monkeypatch.setattr(client_module.EngineClient, "request", recording)

    async def go():
        for top_k in (-1, 20):
            cfg = RolloutConfig(samples_per_prompt=4, max_new_tokens=4, max_inflight_requests=2, top_k=top_k)
            manager = RolloutManager(cfg, [Prompt("p", [3, 4, 5])], lambda p, t: 0.0, endpoints=[server.url])
            await manager.start(max_requests=2)
            await manager.join()
            await manager.stop()
        # multi-turn: each turn one sample of the conversation's ids so far (tests/env_helpers.py's environment)
        cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=4, max_inflight_requests=2,
                            env={"name": "env_helpers:Scripted", "options": {"turns": 2}})
        manager = RolloutManager(cfg, [Prompt("p", [3, 4, 5])], lambda p, t: 0.0, endpoints=[server.url],
                                 tokenizer=server.engine.tokenizer)
        await manager.start(max_requests=1)
        await manager.join()
        await manager.stop()
        async with client_module.EngineClient(server.url) as client:
            for sampling in (ToolSamplingConfig(max_new_tokens=4, seed=3), ToolSamplingConfig(max_new_tokens=4),
                             ToolSamplingConfig(temperature=0.0, max_new_tokens=4, samples_per_request=2)):
                await sample(client, [3, 4], 3, sampling, seed_key=("x",))

    asyncio.run(go())
    return bodies


def test_every_generate_body_the_clients_build_passes_sglang(server, monkeypatch, io):
    """srt/entrypoints/api_contract.py generate_contract_error (the /generate gate), srt/managers/io_struct.py
    GenerateReqInput as FastAPI parses it + normalize_batch_and_arguments, srt/sampling/sampling_params.py
    SamplingParams(**sp).normalize(tokenizer).verify(vocab_size): the server's four stages."""
    bodies = recorded_generate_bodies(server, monkeypatch)
    assert len(bodies) >= 10 and {b["sampling_params"].get("n", 1) for b in bodies} >= {1, 2, 3, 4}
    assert sum(".t1." in b.get("rid", "") for b in bodies) == 2  # the multi-turn conversations' second turns
    assert any("sampling_seed" in b["sampling_params"] for b in bodies)
    for body in bodies:
        assert sgl.generate_contract_error(body) is None, body
        obj = sgl.parse_http_body(io.GenerateReqInput, body)
        assert obj.input_ids == body["input_ids"] and obj.return_logprob == body.get("return_logprob", False)
        assert obj.rid == body.get("rid")
        obj.normalize_batch_and_arguments()  # raises on a batch / rid / n combination SGLang cannot serve
        n = body["sampling_params"].get("n", 1)
        assert obj.batch_size == 1 and (n == 1 or len(obj.input_ids) == n)  # one prompt, n samples
        params = sgl.validate_sampling_params(body["sampling_params"], vocab_size=server.engine.vocab_size)
        expected = dict(body["sampling_params"])
        if expected.get("top_k") == -1:
            expected["top_k"] = TOP_K_ALL  # SGLang's "all" (our engine uses the same constant)
        if expected.get("temperature", 1.0) < SAMPLING_EPS:
            expected.update(temperature=1.0, top_k=1)  # greedy, as SGLang normalizes it (so does our engine)
        assert {key: getattr(params, key) for key in expected} == expected
    assert sgl.sampling_params_module().TOP_K_ALL == TOP_K_ALL
    assert sgl.sampling_params_module()._SAMPLING_EPS == SAMPLING_EPS


def sglang_refusal(body: dict, io, vocab_size: int) -> str | None:
    """Why SGLang's server answers 400 to a /generate body, or None when it serves it: FastAPI's parse of
    GenerateReqInput + api_contract.py, normalize_batch_and_arguments, SamplingParams normalize/verify."""
    try:
        sgl.parse_http_body(io.GenerateReqInput, body).normalize_batch_and_arguments()
        sgl.validate_sampling_params(body["sampling_params"], vocab_size=vocab_size)
    except (sgl.HttpBodyRejected, TypeError, ValueError) as err:
        return str(err)
    return None


@pytest.mark.parametrize("sampling", [
    {"top_p": 0}, {"top_p": 1.5}, {"temperature": -1}, {"top_k": 0}, {"top_k": -2}, {"min_p": 2},
    {"max_new_tokens": -1}, {"temprature": 0.5}, {"stop_token_ids": "2"}, {"n": 1.5}, {"ignore_eos": "yes"},
    {"max_new_tokens": 2.5}, {"sampling_seed": "7"},
])
def test_the_local_engine_refuses_what_sglang_refuses(sampling, server, io):
    """Every stage of SGLang's /generate (io_struct.py, api_contract.py, sampling_params.py) refuses each
    body; so does the local engine (HTTP 400), so an end-to-end test on CPU fails where a cluster would."""
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, **sampling}}
    assert sglang_refusal(body, io, server.engine.vocab_size) is not None
    with pytest.raises(ProtocolError):
        SamplingParams.from_json(body["sampling_params"])
    assert client_module.post_json(server.url + "/generate", body)[0] == 400


def test_where_the_local_engine_is_stricter_than_sglang(server, io):
    """n = 0 passes every SGLang check and is served as one sample (io_struct.py _handle_parallel_sampling
    treats it as a single request); the local engine refuses it (the project's configs never send it)."""
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2, "n": 0}}
    assert sglang_refusal(body, io, server.engine.vocab_size) is None
    assert client_module.post_json(server.url + "/generate", body)[0] == 400


def test_weight_version_spans_match_sglang(io):
    """srt/utils/weight_versions.py compute_weight_version_spans (what every finished request reports in
    meta_info.weight_versions): the local engine's spans equal SGLang's for random update histories."""
    wv = sgl.load_module("sglang.srt.utils.weight_versions")
    rng = random.Random(0)
    for _ in range(300):
        total = rng.randint(0, 12)
        events, marks = [], sorted(rng.randint(0, total) for _ in range(rng.randint(0, 4)))
        for i, mark in enumerate(marks):
            events.append((rng.choice(["default", "1", "2", str(i)]), mark))
        current = rng.choice(["1", "2", "3"])
        req = Req([1], SamplingParams(), "r", output_ids=[0] * total, version_events=events)
        theirs = wv.compute_weight_version_spans(
            [wv.WeightVersionEvent(old_version=v, num_output_tokens=n) for v, n in events], current, total)
        assert req.weight_version_spans(current) == [{"version": s.version, "start": s.start, "end": s.end}
                                                     for s in theirs], (events, current, total)


def test_rwlock_order_matches_sglang():
    """srt/utils/aio_rwlock.py: the local engine's lock grants readers and writers in SGLang's order on the
    same interleaving (readers in flight, a writer queues, new readers queue behind the writer)."""
    def order(lock_cls):
        granted = []

        async def scenario():
            lock = lock_cls()

            async def reader(name, hold):
                await lock.acquire_reader()
                granted.append(name)
                await asyncio.sleep(hold)
                await lock.release_reader()

            async def writer(name):
                await lock.acquire_writer()
                granted.append(name)
                await asyncio.sleep(0.01)
                await lock.release_writer()

            tasks = [asyncio.create_task(reader("r1", 0.05)), asyncio.create_task(reader("r2", 0.02))]
            await asyncio.sleep(0.005)
            tasks.append(asyncio.create_task(writer("w1")))
            await asyncio.sleep(0.005)
            tasks += [asyncio.create_task(reader("r3", 0.01)), asyncio.create_task(writer("w2"))]
            await asyncio.gather(*tasks)

        asyncio.run(scenario())
        return granted

    ours, theirs = order(RWLock), order(sgl.load_module("sglang.srt.utils.aio_rwlock").RWLock)
    assert ours == theirs == ["r1", "r2", "w1", "w2", "r3"]  # writers first while one waits


# -------------------------------------------------------------------------------------------------
# weight updates
# -------------------------------------------------------------------------------------------------
SGLANG_BODY_CLASSES = {  # endpoint -> the io_struct class SGLang's http_server.py declares for its body
    "/pause_generation": "PauseGenerationReqInput", "/continue_generation": "ContinueGenerationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput", "/end_weight_update": "EndWeightUpdateReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput", "/abort_request": "AbortReq",
}


def test_every_weight_update_body_parses_as_sglang_parses_it(model_dir, io, monkeypatch, tmp_path):
    """srt/managers/io_struct.py through srt/entrypoints/http_server.py's FastAPI body parse: every control
    body a push sends (broadcast and disk; a failed engine's abort too) is accepted and read back as sent."""
    calls = []
    original = weight_sync.post_json

    def recording(url, body, timeout_s=60.0):
        calls.append((url.rsplit("/", 1)[1], json.loads(json.dumps(body))))
        return original(url, body, timeout_s)

    monkeypatch.setattr(weight_sync, "post_json", recording)

    class Fails(LocalEngine):  # refuses its first load: the push then aborts what it holds
        failed = False

        def load_named_tensors(self, named):
            if not self.failed:
                self.failed = True
                raise RuntimeError("no room")
            return super().load_named_tensors(named)

    state = perturbed_state_dict(model_dir, seed=1)
    with ServerThread(LocalEngine(model_dir)) as a, ServerThread(Fails(model_dir)) as b:
        with WeightBroadcaster([a.url, b.url], bucket_bytes=20_000) as sync:
            sync.push(state.items(), version="1")
            sync.push(state.items(), version="2")
        with WeightBroadcaster([a.url], mode="disk", disk_dir=str(tmp_path), pause_mode="abort") as sync:
            sync.push(state.items(), version="3")
    seen = set()
    for path, body in calls:
        cls = getattr(io, SGLANG_BODY_CLASSES["/" + path])
        parsed = sgl.parse_http_body(cls, body)
        for key, value in body.items():
            assert getattr(parsed, key) == value, (path, key)
        seen.add("/" + path)
    assert seen == set(SGLANG_BODY_CLASSES)


def test_buckets_rebuild_with_sglang_flattened_tensor_bucket():
    """srt/weight_sync/tensor_bucket.py: what the receiver allocates from a bucket's names/dtypes/shapes
    (FlattenedTensorBucket.empty, as model_runner_components/weight_updater.py does) has our bytes' size
    and rebuilds our tensors exactly, across dtypes (a bf16 tensor of odd length starts a new bucket)."""
    ftb = sgl.load_module("sglang.srt.weight_sync.tensor_bucket").FlattenedTensorBucket
    gen = torch.Generator().manual_seed(0)
    tensors = [("a", torch.randn(3, 5, generator=gen)), ("b", torch.randn(3, generator=gen).bfloat16()),
               ("c", torch.randn(4, generator=gen)), ("d", torch.arange(6)), ("e", torch.randn(2, generator=gen).half())]
    buckets = list(iter_buckets(tensors, bucket_bytes=64))
    assert [b.names for b in buckets] == [["a"], ["b"], ["c", "d"], ["e"]]
    rebuilt = {}
    for bucket in buckets:
        req = bucket.request()
        theirs = ftb.empty(req.names, req.dtypes, req.shapes, "cpu")
        flat = theirs.get_flattened_tensor()
        assert flat.numel() == bucket.nbytes and flat.dtype == torch.uint8
        flat.copy_(Bucket.flatten(bucket))
        rebuilt.update(theirs.reconstruct_tensors())
    for name, tensor in tensors:
        assert rebuilt[name].dtype == tensor.dtype and torch.equal(rebuilt[name], tensor), name


@pytest.fixture(scope="module")
def sglang_core(model_dir):
    """tests/sglang_core_server.py: an engine whose control path is SGLang's own code, in a subprocess."""
    def start(port: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "sglang_core_server.py"),
                                 "--model", model_dir, "--port", str(port)], env=engine_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    try:
        proc, url = start_on_free_port(start, "sglang core server")
    except ServerExited as err:
        pytest.fail(f"sglang core server did not start: {err}\n{err.proc.stdout.read()[-3000:]}")
    yield url
    proc.kill()
    proc.wait(10)


def core_state(url: str) -> dict:
    with urllib.request.urlopen(url + "/debug/state", timeout=10) as resp:
        return json.loads(resp.read())


def sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.mark.multiproc
@pytest.mark.parametrize("pause_mode", ["retract", "abort"])
def test_a_push_runs_through_sglang_own_weight_update_code(sglang_core, model_dir, pause_mode):
    """srt/managers/tokenizer_manager.py (pause/continue), tokenizer_control_mixin.py (session, update; the
    reader/writer lock), scheduler_components/weight_updater.py (session state machine, version, flush),
    tp_worker.py, model_runner_components/weight_updater.py (gloo group by srt/utils/common.py's
    init_custom_process_group; FlattenedTensorBucket receive): a whole push, with requests in flight,
    loads every tensor exactly, in SGLang's order: pause -> begin -> buckets (version + flush on the last)
    -> end -> continue."""
    version = {"retract": "1", "abort": "2"}[pause_mode]
    state = perturbed_state_dict(model_dir, seed=int(version))
    events_before = len(core_state(sglang_core)["events"])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        in_flight = [pool.submit(client_module.post_json, sglang_core + "/generate", {"hold_s": 4.0}, 30)
                     for _ in range(3)]
        time.sleep(0.3)
        start = time.monotonic()
        with WeightBroadcaster([sglang_core], bucket_bytes=20_000, pause_mode=pause_mode) as sync:
            report = sync.push(state.items(), version=version)
        pushed_in = time.monotonic() - start
        still_running = [not f.done() for f in in_flight]
        finishes = {f.result(30)[1]["meta_info"]["finish_reason"]["type"] for f in in_flight}
    assert report.failed == {} and report.num_buckets > 1
    # paused: the updates did not wait for the requests' reader locks (each holds one for 4 s)
    assert pushed_in < 3.5 and (pause_mode == "abort" or all(still_running))
    assert finishes == ({"abort"} if pause_mode == "abort" else {"length"})
    after = core_state(sglang_core)
    assert after["weights"] == {n: sha(t) for n, t in state.items()} and after["weight_version"] == version
    events = [tuple(e) for e in after["events"][events_before:]]
    if pause_mode == "abort":  # SGLang aborts everything, then again each second until no request is left
        aborts = len(events) - len(events := [e for e in events if e != ("abort", "True")])
        assert aborts >= 1
    else:
        assert events.pop(0) == ("PauseGenerationReqInput", "retract")
    buckets = [("version", "None")] * (report.num_buckets - 1) + [("version", version), ("flush", "True")]
    assert events == [("runner_begin",)] + buckets + [("runner_end", "False"), ("ContinueGenerationReqInput", "None")]
    assert not after["paused"]


@pytest.mark.multiproc
def test_sglang_refuses_the_old_protocol(sglang_core, model_dir):
    """Points 1 and 3 with SGLang's own code: an update outside a session is refused (HTTP 400,
    scheduler_components/weight_updater.py), and without a pause a session call waits behind every request
    in flight (tokenizer_control_mixin.py _weight_update_session_call takes the writer lock)."""
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "none"}
    status, reply = client_module.post_json(sglang_core + "/update_weights_from_distributed", body)
    assert status == 400 and "must run between begin_weight_update() and end_weight_update()" in reply["message"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        in_flight = pool.submit(client_module.post_json, sglang_core + "/generate", {"hold_s": 3.0}, 30)
        time.sleep(0.3)
        start = time.monotonic()
        begun = pool.submit(client_module.post_json, sglang_core + "/begin_weight_update", {}, 30)
        assert begun.result(30)[0] == 200
        assert time.monotonic() - start > 2.0  # it waited for the request (held 3 s from 0.3 s before the start)
        # (not in_flight.done() here: on a loaded machine the request's reply can reach its client thread after
        # the lock was released and the begin answered; seen in the suite at load 11)
        assert in_flight.result(30)[0] == 200
    assert client_module.post_json(sglang_core + "/end_weight_update", {})[0] == 200


def test_the_project_calls_no_deprecated_sglang_endpoint():
    """srt/entrypoints/http_server.py: /get_model_info and /get_server_info are deprecated for /model_info and
    /server_info. Only the local engine's routes (kept for old clients) may name them."""
    root = os.path.join(os.path.dirname(os.path.dirname(__file__)), "megatron_spo")
    offenders = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and not path.endswith(os.path.join("rollout", "engine_server.py")):
                text = open(path, encoding="utf-8").read()
                offenders += [path for old in ('"/get_model_info"', '"/get_server_info"', '/get_model_info")')
                              if old in text]
    assert offenders == []
