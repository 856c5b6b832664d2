"""The fleet for real: engine processes behind sglang-router, weight sync by gloo broadcast, an engine
killed mid-run and restarted, engines (and the router) the supervisor brings back, and Ctrl-C of `megatron-spo
fleet up` leaving no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from rollout_helpers import engine_env, make_tiny_llama, perturbed_state_dict  # noqa: E402

from megatron_spo.net import free_port  # noqa: E402
from megatron_spo.rollout.client import get_json, post_json  # noqa: E402
from megatron_spo.rollout.config import RolloutConfig  # noqa: E402
from megatron_spo.rollout.fleet import EngineWatch, Fleet, RouterHealth  # noqa: E402
from megatron_spo.rollout.manager import Prompt, RolloutManager  # noqa: E402
from megatron_spo.rollout.weight_sync import WeightBroadcaster, WeightSyncError

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    # no restarts by the supervisor: these tests kill and restart engines themselves
    with Fleet(model_dir, 2, env=engine_env(), log_dir=str(tmp_path_factory.mktemp("fleet_logs")),
               watch=EngineWatch(max_restarts=0)) as f:
        yield f


@pytest.fixture(scope="module")
def new_weights(model_dir):
    return perturbed_state_dict(model_dir, seed=11)


def reference_greedy(model_dir: str, state: dict, prompt: list[int], steps: int):
    """Greedy tokens and their log-probs from a fresh transformers model holding ``state``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.load_state_dict(state)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0].tolist()
        logits = model(torch.tensor([out])).logits[0, len(prompt) - 1:-1]
    tokens = out[len(prompt):]
    return tokens, torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def versions(fleet: Fleet) -> list[str]:
    return [get_json(u + "/model_info")[1]["weight_version"] for u in fleet.engine_urls]


def test_broadcast_sync_then_router_serves_new_weights(fleet, model_dir, new_weights):
    with WeightBroadcaster(fleet.engine_urls, mode="broadcast", bucket_bytes=30_000) as sync:
        report = sync.push(new_weights.items(), version="1")
    assert report.num_buckets > 1 and report.bytes_sent == sum(t.numel() * 4 for t in new_weights.values())
    assert versions(fleet) == ["1", "1"]
    prompt = [7, 8, 9, 10]
    tokens, logprobs = reference_greedy(model_dir, new_weights, prompt, 8)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True}
    for _ in range(2):  # round robin: once per engine
        status, item = post_json(fleet.router_url + "/generate", body)
        assert status == 200 and item["output_ids"] == tokens and item["meta_info"]["weight_version"] == "1"
        got = torch.tensor([e[0] for e in item["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, logprobs, atol=2e-5, rtol=0)
    # the router does not proxy weight updates: they must go to each engine (docs/engineering-notes.md)
    assert post_json(fleet.router_url + "/update_weights_from_disk", {"model_path": model_dir})[0] == 404


def test_killed_engine_requests_retried_and_restart_rejoins_after_catch_up(fleet, model_dir, new_weights):
    assert versions(fleet) == ["1", "1"]
    cfg = RolloutConfig(samples_per_prompt=2, max_new_tokens=24, max_inflight_requests=4, max_retries=10,
                        retry_backoff_s=0.2, retry_backoff_max_s=1.0, request_timeout_s=30, seed=3)
    prompts = [Prompt(f"p{i}", [3 + i, 4, 5 + i]) for i in range(8)]
    victim = fleet.engine_urls[1]

    def run_manager(endpoints, max_requests, kill_after=None, **overrides):
        async def go():
            manager = RolloutManager(cfg.model_copy(update=overrides), prompts, lambda problem, text: 1.0,
                                     endpoints=endpoints)
            manager.set_policy_version(1)
            await manager.start(max_requests=max_requests)
            if kill_after is not None:
                while manager.metrics.groups_delivered < kill_after:
                    await asyncio.sleep(0.02)
                fleet.kill_engine(1)  # SIGKILL while requests are in flight on it
            await manager.join()
            groups = await manager.get_groups(manager.metrics.groups_delivered, timeout_s=5)
            await manager.stop()
            return manager, groups

        return asyncio.run(go())

    # 1. direct routing over both engines; engine 1 dies mid-run: its requests are retried on engine 0
    manager, groups = run_manager(fleet.engine_urls, 30, kill_after=3)
    ids = [g[0].request_id for g in groups]
    assert len(ids) == 30 and len(set(ids)) == 30 and manager.metrics.failed_requests == 0
    assert manager.metrics.duplicates_dropped == 0 and manager.metrics.retries >= 1
    assert all(t.policy_version == 1 for g in groups for t in g)

    # 2. the fleet's watcher took the dead engine out of the router; the router keeps serving
    deadline = time.monotonic() + 10
    while victim in fleet.router_workers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert victim not in fleet.router_workers()
    with WeightBroadcaster(fleet.engine_urls, mode="broadcast") as sync, pytest.raises(
            WeightSyncError, match=f"weight sync to version 1 reached no engine: {{'{victim}': 'unreachable"):
        sync.push(new_weights.items(), version="1", engines=[victim])
    manager, groups = run_manager([fleet.router_url], 6, max_new_tokens=4)
    assert len(groups) == 6 and manager.metrics.failed_requests == 0

    # 3. a restarted engine has the initial weights: not in the router, and given no work by direct routing
    fleet.restart_engine(1)
    assert get_json(victim + "/model_info")[1]["weight_version"] == "default"
    assert victim not in fleet.router_workers()
    manager, groups = run_manager(fleet.engine_urls, 6, max_new_tokens=4)
    assert len(groups) == 6 and [ep.requests for ep in manager.endpoints][1] == 0

    # 4. the trainer's sync call: routed engines are already at "1"; the restarted one is caught up through
    #    the same broadcast path, on its own, and only then added back to the router
    with WeightBroadcaster(fleet.engine_urls, mode="broadcast") as sync:
        assert fleet.sync_weights(sync, new_weights.items(), "1") == []
    assert versions(fleet) == ["1", "1"] and victim in fleet.router_workers()
    manager, groups = run_manager(fleet.engine_urls, 8, max_new_tokens=4)
    assert len(groups) == 8 and all(ep.requests > 0 for ep in manager.endpoints)
    assert all(t.policy_version == 1 for g in groups for t in g)


def test_sigint_of_fleet_up_leaves_no_process(model_dir, tmp_path):
    stderr = open(tmp_path / "fleet.stderr", "w+")  # the fleet picks its ports (and moves one taken meanwhile)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_spo.cli", "fleet", "up", "--model", model_dir,
                             "--engines", "1", "--log-dir", str(tmp_path)],
                            env=engine_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        deadline = time.monotonic() + 180
        line = ""
        while not line.startswith("fleet up:") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                stderr.seek(0)
                raise AssertionError(f"fleet up exited before it was up: {stderr.read()[-2000:]}")
        assert line.startswith("fleet up:"), "fleet never came up"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # one engine + the router
        router_url = line.split()[3].rstrip(",")  # "fleet up: router URL, engines URL ..."
        assert get_json(f"{router_url}/health")[0] == 200
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        survivors = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert survivors == [], f"left behind: {[c.cmdline() for c in survivors]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        stderr.close()


def test_wait_healthy_stops_at_once_when_the_process_behind_a_url_died():
    """The one health wait (rollout/client.py): the fleet's dead() check ends it at once with the process's own
    reason; without it, the timeout names each pending URL and its last answer."""
    from megatron_spo.rollout.client import wait_healthy

    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^engine-0 exited with code 1 before becoming healthy$"):
        wait_healthy([url], timeout_s=60, poll_s=0.1, what="engine-0",
                     dead=lambda u: "engine-0 exited with code 1 before becoming healthy" if u == url else None)
    assert time.monotonic() - t0 < 5
    with pytest.raises(RuntimeError, match=rf"^engine-0 not healthy after 0 s: {url} \("):
        wait_healthy([url], timeout_s=0.2, poll_s=0.1, what="engine-0")


def test_an_engine_whose_port_was_taken_before_it_bound_starts_on_another(model_dir, monkeypatch, caplog):
    """A port the fleet probed can be taken by another process before the engine binds it (the class of a CI
    failure: an outgoing connection took a probed port): the engine starts again on a new port, and the router
    is given the URL it ended on. A port the user gave is not moved: the start fails in one line."""
    import socket

    import megatron_spo.rollout.fleet as fleet_module

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    probes = iter([taken])
    monkeypatch.setattr(fleet_module, "free_port", lambda: next(probes, None) or free_port())
    try:
        with caplog.at_level("WARNING", logger="megatron_spo.fleet"), Fleet(model_dir, 1, env=engine_env()) as f:
            [url] = f.engine_urls
            assert url != f"http://127.0.0.1:{taken}" and get_json(url + "/health", 10)[0] == 200
            assert f"--worker-urls {url} " in " ".join(f.router.command)
            status, body = post_json(f.router_url + "/generate", {"input_ids": [3, 4], "sampling_params": {
                "max_new_tokens": 2, "temperature": 0.0}}, 60)
            assert status == 200 and len(body["output_ids"]) == 2
        assert f"engine0: port {taken} was taken before it could bind; starting it again as {url}" in caplog.text
        caplog.clear()
        probes = iter([None, None, taken])  # the engine's, the router's, then its metrics exporter's: taken
        with caplog.at_level("WARNING", logger="megatron_spo.fleet"), Fleet(model_dir, 1, env=engine_env()) as f:
            assert f"--prometheus-port {taken} " not in " ".join(f.router.command)
            assert get_json(f.router_url + "/health", 10)[0] == 200
        assert f"router: port {taken} was taken before it could bind; starting it again as {f.router_url}" \
            in caplog.text
        with pytest.raises(fleet_module.FleetError, match=r"^engine0 exited with code \d+ before becoming healthy"):
            Fleet(model_dir, 1, env=engine_env(), engine_ports=[taken], router=False).start()
    finally:
        holder.close()


PROBE_ENGINE = f"{sys.executable} {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}/slurm/probe.py engine " \
               "--host {host} --port {port}"  # starts in a second: an SGLang-protocol stub with a weight_version


def until(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(0.05)


def answers(url: str) -> bool:
    try:
        return get_json(url + "/health", 5)[0] == 200
    except OSError:
        return False


def test_the_supervisor_restarts_dead_and_hung_engines_readmits_them_at_the_current_weights_and_drops_after_max(
        tmp_path, caplog):
    """Engine 1 SIGKILLed: out of the router at once, started again on its port, and back in the router only once it
    reports the weight version the engine in service holds (a push would set it; here /update_weight_version does).
    Engine 0 stopped (SIGSTOP: it answers nothing): killed after 3 failed health checks and restarted. Engine 1 killed
    past max_restarts: dropped, in one line, and the fleet goes on. The router killed: started again over the engines
    in service, and a serving engine it loses is added again. Each restart counted (fleet/engine_restarts,
    fleet/router_restarts)."""
    env = dict(engine_env(), SPO_RUN_DIR=str(tmp_path))
    watch = EngineWatch(interval_s=0.2, timeout_s=0.5, failures=3, max_restarts=2)
    with caplog.at_level("INFO", logger="megatron_spo.fleet"), \
            Fleet(None, 2, engine_command=PROBE_ENGINE, env=env, watch=watch,
                  router_health=RouterHealth(interval_s=1, timeout_s=1, failures=2)) as fleet:
        urls = fleet.engine_urls
        for url in urls:  # the weights of a first push
            assert post_json(url + "/update_weight_version", {"new_version": "5"})[0] == 200
        until(lambda: fleet.weight_version == "5", "the supervisor saw version 5 in service")

        fleet.kill_engine(1)
        until(lambda: fleet.engines[1].state == "needs_weights", "engine 1 restarted and answering")
        assert urls[1] not in fleet.router_workers()  # its launch weights ("default") are not the current ones
        assert fleet.metrics()["fleet/engines_needing_weights"] == 1.0
        assert post_json(urls[1] + "/update_weight_version", {"new_version": "5"})[0] == 200  # the push reaches it
        until(lambda: fleet.engines[1].state == "serving" and urls[1] in fleet.router_workers(), "engine 1 back")

        os.kill(fleet.engines[0].proc.pid, signal.SIGSTOP)
        until(lambda: fleet.engines[0].restarts == 1 and answers(urls[0]), "the hung engine 0 killed and restarted")
        assert post_json(urls[0] + "/update_weight_version", {"new_version": "5"})[0] == 200
        until(lambda: fleet.engines[0].state == "serving", "engine 0 back")

        fleet.kill_engine(1)
        until(lambda: fleet.engines[1].restarts == 2 and fleet.engines[1].alive, "engine 1 restarted again")
        fleet.kill_engine(1)
        until(lambda: fleet.engines[1].state == "dropped", "engine 1 dropped")
        assert urls[1] not in fleet.router_workers() and answers(urls[0])

        port = fleet.router_url.rsplit(":", 1)[1]
        os.kill(fleet.router.proc.pid, signal.SIGKILL)
        until(lambda: fleet.router_restarts == 1 and answers(fleet.router_url), "the router restarted")
        assert fleet.router_url.endswith(f":{port}")
        until(lambda: fleet.router_workers().keys() == {urls[0]}, "the new router routes to engine 0 alone")
        assert fleet.router_remove(urls[0])  # the router lost a worker that serves: the supervisor adds it again
        until(lambda: fleet.router_workers().keys() == {urls[0]}, "engine 0 added again")
        assert fleet.metrics() == {"fleet/engine_restarts": 3.0, "fleet/engines_serving": 1.0,
                                   "fleet/engines_needing_weights": 0.0, "fleet/engines_dropped": 1.0,
                                   "fleet/router_restarts": 1.0}
    lines = [r.getMessage() for r in caplog.records]
    assert f"engine1 at {urls[1]} exited with code -9: restarting it on its port (restart 1 of 2) " \
           "[fleet/engine_restarts 1, serving 1 of 2]" in lines
    assert any(m.startswith(f"engine0 at {urls[0]} stopped answering (3 health checks in a row failed): restarting")
               for m in lines)
    assert f"engine1 at {urls[1]} back in service at weight version 5 (restart 1 of 2) [fleet/engine_restarts 1, " \
           "serving 2 of 2]" in lines
    assert any(m.startswith(f"engine1 at {urls[1]} exited with code -9: dropped after 2 restarts (max_restarts); "
                            "the fleet goes on with ") for m in lines)


def test_rejoin_and_watch_bring_back_an_engine_another_launcher_restarted(tmp_path):
    """`fleet rejoin` (slurm/launch_workers.sh, after it restarted an engine): the engine leaves the router at once and
    is added back once it holds the version its peers hold; `fleet watch` SIGKILLs an engine that stops answering."""
    env = dict(engine_env(), SPO_RUN_DIR=str(tmp_path))
    quiet = EngineWatch(interval_s=3600, max_restarts=0)  # the fleet only starts the processes here: its checks sleep
    with Fleet(None, 2, engine_command=PROBE_ENGINE, env=env, watch=quiet) as fleet:
        urls = fleet.engine_urls
        assert post_json(urls[0] + "/update_weight_version", {"new_version": "3"})[0] == 200
        rejoin = subprocess.Popen([sys.executable, "-m", "megatron_spo.rollout.fleet", "rejoin", "--router",
                                   fleet.router_url, "--engine", urls[1], "--peers", ",".join(urls), "--timeout-s",
                                   "120"], env=env, stdout=subprocess.PIPE, text=True)
        until(lambda: urls[1] not in fleet.router_workers(), "engine 1 out of the router")
        assert rejoin.poll() is None  # it reports "default", engine 0 holds "3"
        assert post_json(urls[1] + "/update_weight_version", {"new_version": "3"})[0] == 200
        out, _ = rejoin.communicate(timeout=60)
        assert rejoin.returncode == 0 and out.strip() == f"fleet rejoin: {urls[1]} back in the router at weight version 3"
        assert urls[1] in fleet.router_workers()

        pid = fleet.engines[0].proc.pid
        watcher = subprocess.Popen([sys.executable, "-m", "megatron_spo.rollout.fleet", "watch", "--engine", urls[0],
                                    "--pid", str(pid), "--health-interval-s", "0.2", "--health-timeout-s", "0.5",
                                    "--health-failures", "2"], env=env, stdout=subprocess.PIPE, text=True)
        assert watcher.stdout.readline().startswith(f"fleet watch: {urls[0]} answers")  # judged from now on
        os.kill(pid, signal.SIGSTOP)
        out, _ = watcher.communicate(timeout=60)
        assert out.strip() == f"fleet watch: {urls[0]} stopped answering (2 health checks in a row failed): killed pid {pid}"
        until(lambda: not fleet.engines[0].alive, "the hung engine killed")
