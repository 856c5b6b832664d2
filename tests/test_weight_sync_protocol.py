"""Weight pushes while engines generate, against the local engine that enforces SGLang 0.5.23's rules.

Each test names the issue point it guards (each failed on the weight sync of 2026-11-24):
1. distributed updates only inside a begin/end session (scheduler_components/weight_updater.py);
2. the group counts every engine's TP ranks (rank_offset + tp_rank), read from /server_info;
3. no token is sampled from half-loaded weights, and every token's version label is the weights that sampled
   it: checked exactly, by re-scoring each token under the old and the new model.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import sys
import time
import urllib.request

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rollout_helpers import ServerThread, make_tiny_llama, perturbed_state_dict  # noqa: E402

from megatron_spo.net import free_port  # noqa: E402
from megatron_spo.rollout.client import post_json  # noqa: E402
from megatron_spo.rollout.config import RolloutConfig  # noqa: E402
from megatron_spo.rollout.local_engine import (  # noqa: E402
    FLUSH_REFUSED,
    NO_SESSION,
    SESSION_CLOSED,
    SESSION_OPEN,
    LocalEngine,
)
from megatron_spo.rollout.manager import Prompt, RolloutManager  # noqa: E402
from megatron_spo.rollout.weight_sync import WeightBroadcaster, WeightSyncError

LONG = {"max_new_tokens": 150, "temperature": 1.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def models(model_dir):
    """{version: HF model holding that version's weights}, and the new weights' state dict."""
    from transformers import AutoModelForCausalLM

    new_state = perturbed_state_dict(model_dir, seed=21)
    old = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    new.load_state_dict(new_state)
    return {"default": old, "1": new}, new_state


@contextlib.contextmanager
def engines(model_dir, *tp_sizes, cls=LocalEngine):
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(ServerThread(cls(model_dir, seed=i, tp_size=tp)))
               for i, tp in enumerate(tp_sizes)]


def wait_for_progress(srv: ServerThread, tokens: int, timeout_s: float = 60.0) -> None:
    """Until every request of the engine's running batch has at least ``tokens`` output tokens."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = srv.server.scheduler.batch
        if batch is not None and min(len(r.output_ids) for r in batch.reqs) >= tokens:
            return
        assert time.monotonic() < deadline, "the engine made no progress"
        time.sleep(0.005)


def internal_state(srv: ServerThread) -> dict:
    with urllib.request.urlopen(srv.url + "/server_info", timeout=10) as resp:
        return json.loads(resp.read())["internal_states"][0]


def check_tokens_against_versions(models: dict, prompt: list[int], output: list[int], logprobs: list[float],
                                  spans) -> None:
    """Each token's reported log-prob (T = 1) equals the one its labelled version's model gives it, and not the
    other version's: the label is the truth about which weights sampled it."""
    for version, start, end in spans:
        assert end > start
        for name, model in models.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[start:end, 0]
            diff = (torch.tensor(logprobs[start:end]) - expected).abs().max().item()
            where = f"tokens {start}:{end} labelled {version}, scored under {name}: max |diff| {diff:.3g}"
            # float32 batched decoding vs one forward: ~1e-4; another version's weights: O(1)
            assert diff < 2e-3 if name == version else diff > 5e-2, where


def spans_of(item: dict) -> list[tuple[str, int, int]]:
    return [(s["version"], s["start"], s["end"]) for s in item["meta_info"]["weight_versions"]]


# -------------------------------------------------------------------------------------------------
# the engine's rules
# -------------------------------------------------------------------------------------------------
def test_distributed_update_needs_a_session_as_sglang_does(model_dir):
    """Point 1: sglang 0.5.23 refuses /update_weights_from_distributed outside begin/end (HTTP 400)."""
    with engines(model_dir, 1) as [srv]:
        body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[32]], "group_name": "g"}
        status, reply = post_json(srv.url + "/update_weights_from_distributed", body)
        assert (status, reply) == (400, {"success": False, "message": NO_SESSION})
        assert post_json(srv.url + "/end_weight_update", {}) == (400, {"success": False, "message": SESSION_CLOSED})
        assert post_json(srv.url + "/begin_weight_update", {})[0] == 200
        assert post_json(srv.url + "/begin_weight_update", {}) == (400, {"success": False, "message": SESSION_OPEN})
        assert post_json(srv.url + "/end_weight_update", {})[0] == 200


def test_push_applies_on_an_engine_that_enforces_sessions(model_dir, models):
    """Point 1 end to end: every bucket inside one session; the engine holds exactly the new weights."""
    _, new_state = models
    with engines(model_dir, 1) as [srv], WeightBroadcaster([srv.url], bucket_bytes=20_000) as sync:
        report = sync.push(new_state.items(), version="1")
        assert report.engines_updated == [srv.url] and report.failed == {} and report.num_buckets > 1
        for name, tensor in srv.engine.model.state_dict().items():
            assert torch.equal(tensor, new_state[name]), name
        state = internal_state(srv)
        assert (state["weight_version"], state["paused"], state["weight_update_session_open"]) == ("1", False, False)


def test_flush_is_refused_while_requests_run_and_in_place_pause_keeps_them_running(model_dir, models, tmp_path):
    """SGLang: an update's flush fails while requests run or wait (unless paused); an in_place pause keeps them
    running, so the update reports failure although the weights and the version changed (which is why a push
    never pauses in_place); retract moves them out of the batch and the flush succeeds."""
    from safetensors.torch import save_file

    _, new_state = models
    save_file({k: v.contiguous() for k, v in new_state.items()}, str(tmp_path / "model.safetensors"))
    with engines(model_dir, 1) as [srv], concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(post_json, srv.url + "/generate", {"input_ids": [3, 4, 5], "sampling_params": LONG})
        wait_for_progress(srv, 5)
        assert post_json(srv.url + "/flush_cache", {})[0] == 400
        assert post_json(srv.url + "/pause_generation", {"mode": "in_place"})[0] == 200
        status, reply = post_json(srv.url + "/update_weights_from_disk",
                                  {"model_path": str(tmp_path), "weight_version": "1"})
        assert (status, reply["success"], reply["message"]) == (400, False, FLUSH_REFUSED)
        assert internal_state(srv)["weight_version"] == "1"  # SGLang records the version before the flush
        assert post_json(srv.url + "/pause_generation", {"mode": "retract"})[0] == 200
        assert post_json(srv.url + "/flush_cache", {})[0] == 200
        assert post_json(srv.url + "/pause_generation", {"mode": "sideways"})[0] == 400
        assert post_json(srv.url + "/continue_generation", {})[0] == 200
        status, item = running.result(60)
        assert status == 200 and item["meta_info"]["finish_reason"]["type"] == "length"
        assert item["meta_info"]["num_retractions"] == 1


class PacedEngine(LocalEngine):
    """10 ms per sampled token: long requests stay in flight for seconds."""

    def generator(self, req):
        time.sleep(0.01)
        return super().generator(req)


def test_update_without_pause_waits_for_requests_in_flight(model_dir):
    """SGLang's reader/writer lock: a weight-update call on an engine that is not paused waits until every
    /generate in flight has returned (point 3's stall: with 256 long requests a bucket outlives the group
    timeout), and a /generate arriving meanwhile waits behind it."""
    with engines(model_dir, 1, cls=PacedEngine) as [srv], concurrent.futures.ThreadPoolExecutor(3) as pool:
        first = pool.submit(post_json, srv.url + "/generate", {"input_ids": [3, 4], "sampling_params": LONG}, 60)
        wait_for_progress(srv, 5)
        begin = pool.submit(post_json, srv.url + "/begin_weight_update", {}, 60)
        time.sleep(0.3)
        assert not begin.done()  # the writer waits for the reader in flight
        later = pool.submit(post_json, srv.url + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
        time.sleep(0.3)
        assert not later.done() and not first.done()  # a new reader queues behind the waiting writer
        assert first.result(60)[0] == begin.result(60)[0] == later.result(60)[0] == 200


def test_request_ids_in_flight_are_refused_and_n_samples_get_fresh_ids(model_dir):
    with engines(model_dir, 1) as [srv], concurrent.futures.ThreadPoolExecutor(2) as pool:
        body = {"input_ids": [3, 4], "sampling_params": LONG, "rid": "r1"}
        first = pool.submit(post_json, srv.url + "/generate", body)
        wait_for_progress(srv, 2)
        status, reply = post_json(srv.url + "/generate", body)
        assert status == 400 and "Duplicate request ID detected: r1" in reply["error"]["message"]
        assert first.result(60)[1]["meta_info"]["id"] == "r1"  # one prompt, n = 1: the rid comes back
        status, items = post_json(srv.url + "/generate", {**body, "sampling_params": {"max_new_tokens": 2, "n": 2}})
        assert status == 200 and len({i["meta_info"]["id"] for i in items} | {"r1"}) == 3


# -------------------------------------------------------------------------------------------------
# pushes under load
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["broadcast", "disk"])
def test_push_during_generation_labels_every_token_with_the_weights_that_sampled_it(model_dir, models, mode,
                                                                                    tmp_path):
    """Point 3: requests in flight are retracted at a token boundary, resumed under the new weights, and report
    weight_versions [default, 1]; re-scoring each token under both models proves every label; no token was
    sampled while a session had loaded part of the weights; the push did not wait for them to finish."""
    version_models, new_state = models
    prompts = [[3 + i, 4, 5] for i in range(4)]
    with engines(model_dir, 1) as [srv], concurrent.futures.ThreadPoolExecutor(1) as pool:
        batch = pool.submit(post_json, srv.url + "/generate", {"input_ids": prompts, "return_logprob": True,
                                                               "sampling_params": {**LONG, "n": 2}}, 120)
        wait_for_progress(srv, 10)
        with WeightBroadcaster([srv.url], mode=mode, bucket_bytes=20_000, disk_dir=str(tmp_path)) as sync:
            report = sync.push(new_state.items(), version="1")
        assert not batch.done(), "the push waited for the requests in flight"
        status, items = batch.result(120)
        state = internal_state(srv)
    assert status == 200 and report.engines_updated == [srv.url] and report.failed == {}
    assert 0 < report.pause_seconds < report.seconds
    assert state["tokens_sampled_with_partial_weights"] == 0 and state["retracted"] == 8
    for k, item in enumerate(items):
        spans = spans_of(item)
        assert [v for v, _, _ in spans] == ["default", "1"] and item["meta_info"]["weight_version"] == "1"
        assert item["meta_info"]["num_retractions"] == 1 and spans[-1][2] == 150
        check_tokens_against_versions(version_models, prompts[k // 2], item["output_ids"],
                                      [e[0] for e in item["meta_info"]["output_token_logprobs"]], spans)


@pytest.mark.parametrize("pause_mode, policy", [("abort", "tag"), ("retract", "tag"), ("retract", "drop")])
def test_manager_delivers_each_request_once_with_true_versions_across_a_push(model_dir, models, pause_mode, policy):
    """Point 3 through the rollout manager: aborted requests are sent again (never delivered twice); a sample
    spanning the push is kept with policy_version = its oldest token's version (tag) or generated again
    (drop); every delivered token's version label is exact."""
    version_models, new_state = models
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=120, max_inflight_requests=3, temperature_range=(1, 1),
                        top_p=1.0, mixed_version_policy=policy, seed=2)
    prompts = [Prompt(f"p{i}", [3 + i, 4, 5]) for i in range(6)]
    with engines(model_dir, 1) as [srv]:
        async def go():
            manager = RolloutManager(cfg, prompts, lambda problem, text: 0.0, endpoints=[srv.url])
            await manager.start(max_requests=6)
            await asyncio.to_thread(wait_for_progress, srv, 10)
            with WeightBroadcaster([srv.url], pause_mode=pause_mode, bucket_bytes=20_000) as sync:
                report = await asyncio.to_thread(sync.push, new_state.items(), "1")
            manager.set_policy_version(1)
            await manager.join()
            groups = await manager.get_groups(manager.metrics.groups_delivered, timeout_s=5)
            await manager.stop()
            return manager.metrics, groups, report

        metrics, groups, report = asyncio.run(go())
    assert report.failed == {} and len(groups) == 6 and len({g[0].request_id for g in groups}) == 6
    assert metrics.failed_requests == 0 and metrics.duplicates_dropped == 0
    trajectories = [t for g in groups for t in g]
    mixed = [t for t in trajectories if t.mixed_versions]
    if pause_mode == "abort":
        assert metrics.aborted_requests >= 1 and not mixed
    elif policy == "drop":
        assert metrics.mixed_version_dropped >= 1 and not mixed
    else:
        assert mixed and metrics.mixed_version_samples == len(mixed) and all(t.policy_version == 0 for t in mixed)
    for t in trajectories:
        spans = t.weight_versions
        assert t.policy_version == min(0 if v == "default" else int(v) for v, _, _ in spans)
        check_tokens_against_versions(version_models, t.prompt_tokens, t.response_tokens, t.behaviour_logprobs,
                                      spans)


def test_group_counts_tp_ranks_read_from_the_engines(model_dir, models):
    """Point 2: a TP-2 engine joins the group as two ranks; the sender reads tp_size from /server_info (world 4
    for TP 2 + TP 1) and refuses an engine whose report disagrees with the launch config, before any byte."""
    _, new_state = models
    with engines(model_dir, 2, 1) as [tp2, tp1]:
        with WeightBroadcaster([tp2.url, tp1.url], bucket_bytes=20_000) as sync:
            report = sync.push(new_state.items(), version="1")
            assert sync.tp_sizes == {tp2.url: 2, tp1.url: 1}
        assert report.engines_updated == [tp2.url, tp1.url] and report.failed == {}
        for srv in (tp2, tp1):
            assert all(torch.equal(t, new_state[n]) for n, t in srv.engine.model.state_dict().items())
        with WeightBroadcaster([tp2.url, tp1.url], engine_tp_sizes=[1, 1]) as sync:
            report = sync.push(perturbed_state_dict(model_dir, seed=5).items(), version="2")
        assert report.engines_updated == [tp1.url]
        assert report.failed == {tp2.url: "/server_info reports tp_size 2, the launch config says 1"}
        assert internal_state(tp2)["weight_version"] == "1" and not internal_state(tp2)["paused"]


class FlakyEngine(LocalEngine):
    """Fails its next ``failures`` weight loads (after receiving them), like a GPU that ran out of memory."""

    failures = 0

    def load_named_tensors(self, named):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("CUDA out of memory (simulated)")
        return super().load_named_tensors(named)


def test_an_engine_that_misses_a_push_serves_nothing_until_a_later_push_resyncs_it(model_dir, models):
    _, new_state = models
    with engines(model_dir, 1, 1, cls=FlakyEngine) as [good, flaky], \
            concurrent.futures.ThreadPoolExecutor(1) as pool, \
            WeightBroadcaster([good.url, flaky.url], bucket_bytes=20_000) as sync:
        flaky.engine.failures = 1
        in_flight = pool.submit(post_json, flaky.url + "/generate", {"input_ids": [3, 4], "sampling_params": LONG})
        wait_for_progress(flaky, 5)
        report = sync.push(new_state.items(), version="1")
        assert report.engines_updated == [good.url] and list(report.failed) == [flaky.url]
        assert "bucket 0" in report.failed[flaky.url] and "CUDA out of memory" in report.failed[flaky.url]
        assert report.metrics()["weight_sync/failed"] == 1.0 and report.metrics()["weight_sync/engines_failed"] == 1
        status, item = in_flight.result(30)  # aborted, so its client retries elsewhere
        assert status == 200 and item["meta_info"]["finish_reason"]["type"] == "abort"
        state = internal_state(flaky)
        assert state["paused"] and state["weight_version"] == "default"  # old label: version gating skips it
        assert sync.lagging == {flaky.url: report.failed[flaky.url]}

        report = sync.push(new_state.items(), version="2")
        assert report.engines_updated == [good.url, flaky.url] and report.resynced == [flaky.url]
        assert sync.lagging == {} and not internal_state(flaky)["paused"]
        assert all(torch.equal(t, new_state[n]) for n, t in flaky.engine.model.state_dict().items())
        status, item = post_json(flaky.url + "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and item["meta_info"]["weight_version"] == "2"

        flaky.engine.failures = good.engine.failures = 1
        with pytest.raises(WeightSyncError, match="weight sync to version 3 reached no engine"):
            sync.push(new_state.items(), version="3")


def test_push_drains_the_collective_gather_even_when_it_fails(model_dir):
    consumed = []

    def gather():
        for i in range(5):
            consumed.append(i)
            yield f"w{i}", torch.zeros(3)

    with WeightBroadcaster([f"http://127.0.0.1:{free_port()}"]) as sync, pytest.raises(WeightSyncError):
        sync.push(gather(), version="1")
    assert consumed == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="in_place keeps requests running"):
        WeightBroadcaster(["http://x"], pause_mode="in_place")


def test_pause_abort_returns_once_nothing_is_in_flight(model_dir):
    with engines(model_dir, 1) as [srv], concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(post_json, srv.url + "/generate", {"input_ids": [3 + i, 4], "sampling_params": LONG})
                   for i in range(2)]
        # both past the pause gate (a request that reaches the engine after the pause waits for the continue, as
        # in SGLang; this test is about the ones in flight): each holds the lock while it runs
        deadline = time.monotonic() + 30
        while srv.server.model_update_lock.readers < 2:
            assert time.monotonic() < deadline, "the two requests never reached the engine"
            time.sleep(0.005)
        wait_for_progress(srv, 3)
        assert post_json(srv.url + "/pause_generation", {"mode": "abort"})[0] == 200
        # abort returned only once no /generate held the lock (read on the server: the clients' futures finish a
        # little later, when the replies have crossed the socket); a new /generate waits on the pause before it
        # takes the lock, so "not held now" means "not held when abort returned"
        assert srv.server.model_update_lock.readers == 0
        assert {f.result(30)[1]["meta_info"]["finish_reason"]["type"] for f in running} == {"abort"}
        blocked = pool.submit(post_json, srv.url + "/generate", {"input_ids": [3], "sampling_params": {"max_new_tokens": 2}})
        time.sleep(0.3)
        assert not blocked.done()  # new requests wait while paused
        assert post_json(srv.url + "/continue_generation", {})[0] == 200
        assert blocked.result(30)[0] == 200


def test_manager_refuses_engines_whose_n_samples_would_be_copies(model_dir):
    """Point 4 for rollouts: under SGLang's deterministic inference the n samples of a request share a seed."""
    cfg = RolloutConfig(samples_per_prompt=4, max_new_tokens=4)
    with ServerThread(LocalEngine(model_dir, deterministic=True)) as srv:
        async def go():
            manager = RolloutManager(cfg, [Prompt("p", [3, 4])], lambda p, t: 0.0, endpoints=[srv.url])
            with pytest.raises(ValueError, match=r"run with --enable-deterministic-inference: the 4 samples"):
                await manager.start()
            await manager.stop()

        asyncio.run(go())


def test_a_request_whose_client_went_away_is_aborted(model_dir):
    """SGLang aborts a request whose HTTP client disconnected (tokenizer_manager.py _stream_one_response): its
    decoding stops and its rid is free again."""
    with engines(model_dir, 1, cls=PacedEngine) as [srv]:
        body = {"input_ids": [3, 4], "sampling_params": LONG, "rid": "gone"}
        with pytest.raises(OSError):  # the client's timeout: it closes the connection
            post_json(srv.url + "/generate", body, timeout_s=0.5)
        deadline = time.monotonic() + 10
        while internal_state(srv)["aborted"] < 1:
            assert time.monotonic() < deadline, "the engine kept decoding for a client that left"
            time.sleep(0.05)
        status, item = post_json(srv.url + "/generate", {**body, "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and item["meta_info"]["id"] == "gone"
