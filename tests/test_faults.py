"""Faults a real cluster produces (issue 28): a rollout fleet that never answers, SIGTERM in every phase, and
SGLang's /health, which blocks while generation is paused and then answers 503."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from rollout_helpers import ServerThread, make_tiny_llama, perturbed_state_dict  # noqa: E402

from megatron_spo.net import free_port  # noqa: E402
from megatron_spo.rollout.client import get_json, post_json  # noqa: E402
from megatron_spo.rollout.config import RolloutConfig  # noqa: E402
from megatron_spo.rollout.local_engine import LocalEngine  # noqa: E402
from megatron_spo.rollout.manager import Prompt, RolloutManager  # noqa: E402
from megatron_spo.rollout.weight_sync import WeightBroadcaster  # noqa: E402
from megatron_spo.run_layout import PreemptionHandler, Stopped  # noqa: E402
from megatron_spo.training.online import FleetUnavailable, OnlineSource  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("tiny") / "model"))


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


def source_on(url: str, **rollout) -> OnlineSource:
    cfg = RolloutConfig(samples_per_prompt=1, max_new_tokens=4, max_inflight_requests=2, retry_backoff_s=0.1,
                        retry_backoff_max_s=0.2, **rollout)
    return OnlineSource(RolloutManager(cfg, [Prompt("p", [3, 4])], lambda p, t: 0.0, endpoints=[url]), q0=None)


# -- a fleet that never answers --------------------------------------------------------------------------------
def test_a_fleet_that_never_answers_is_one_line_after_engine_wait_s():
    url = dead_url()
    t0 = time.monotonic()  # the wait counts from the source's start
    source = source_on(url, engine_wait_s=1.5)
    try:
        with pytest.raises(FleetUnavailable) as err:
            source.take(1)
    finally:
        source.close()
    waited = time.monotonic() - t0
    assert 1.5 <= waited < 5, waited  # not rollout.wait_timeout_s (30 min)
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"rollout fleet: no engine answered within 1.5 s (rollout.engine_wait_s): {url} (")
    assert "Connection refused" in message, message


def test_engine_wait_s_is_a_positive_finite_field():
    from megatron_spo.config import ConfigError, build_config

    assert RolloutConfig().engine_wait_s == 600.0
    for bad in (0, -1, float("inf"), True):
        with pytest.raises(ConfigError, match="engine_wait_s"):
            build_config(RolloutConfig, {"engine_wait_s": bad})


# -- SIGTERM ---------------------------------------------------------------------------------------------------
def test_sigterm_ends_a_wait_for_rollouts_within_a_second():
    """The trainer's wait for a batch polls the PreemptionHandler: SIGTERM ends it in ~POLL_S with the reason,
    instead of being noticed only after the step (which never comes with a dead fleet)."""
    source = source_on(dead_url())
    handler = PreemptionHandler()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        t0 = time.monotonic()
        with pytest.raises(Stopped, match=r"^SIGTERM received while waiting for rollouts$"):
            source.take(1)
        assert time.monotonic() - t0 < 2.0
    finally:
        timer.cancel()
        handler.restore()
        source.close()


def test_sigterm_ends_the_wait_for_engines_before_a_push_and_the_gather_is_drained():
    source = source_on(dead_url())
    source.broadcaster = type("NoPush", (), {"engine_urls": [dead_url()]})()
    consumed = []

    def tensors():
        for i in range(3):
            consumed.append(i)
            yield f"t{i}", None

    handler = PreemptionHandler()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    try:
        timer.start()
        with pytest.raises(Stopped, match="SIGTERM received while waiting for the rollout engines to answer"):
            source.push_weights(1, tensors())
    finally:
        timer.cancel()
        handler.restore()
        source.broadcaster = None
        source.close()
    assert consumed == [0, 1, 2]  # every trainer rank's collective gather was seen through


def _train_cmd(tmp_path: Path, model_dir: str) -> list[str]:
    cfg = tmp_path / "train.yaml"
    cfg.write_text(f"run_dir: {tmp_path / 'run'}\nsteps: 2\nalgo: grpo\ninit: {{hf: {model_dir}}}\n"
                   f"task: {{kind: toy}}\nfleet: {{router_url: '{dead_url()}'}}\n"
                   "batch: {sequences_per_step: 8, max_tokens_per_micro_batch: 48, max_seq_length: 64}\n"
                   "rollout: {temperature_range: [1.0, 1.0], top_p: 1.0}\n"
                   "checkpoint: {interval: 100, export_hf: false}\nlogging: {progress: false}\n")
    return [sys.executable, "-m", "megatron_spo.cli", "train", str(cfg)]


def _sigterm_when(proc: subprocess.Popen, ready, timeout_s: float = 240.0) -> tuple[str, str, float]:
    """SIGTERM once ready(stdout so far) holds; (stdout, stderr, seconds from the signal to the exit)."""
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, b=b: b.extend(iter(s.readline, "")), daemon=True)
               for s, b in ((proc.stdout, out), (proc.stderr, err))]  # both drained: a full pipe blocks the child
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout_s
    while not ready("".join(out)):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(out) + "".join(err)[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    seconds = time.monotonic() - t0
    for reader in readers:
        reader.join(10)
    return "".join(out), "".join(err), seconds


@pytest.mark.slow
def test_train_against_a_dead_fleet_exits_on_sigterm_with_the_reason(tmp_path, model_dir):
    """`megatron-spo train` waiting on a fleet that never answers (it used to retry for ever and ignore
    SIGTERM): SIGTERM once it waits for its first batch -> exit 0 within 30 s, one line with the reason."""
    proc = subprocess.Popen(_train_cmd(tmp_path, model_dir), cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    out, err, seconds = _sigterm_when(proc, lambda text: "[megatron-spo] layout:" in text)
    assert proc.returncode == 0, err[-3000:]
    assert seconds < 30, seconds
    assert "Traceback" not in err and "Traceback" not in out, err[-3000:]
    assert out.strip().splitlines()[-1] == ("[megatron-spo] preempted: no step had finished, exiting (SIGTERM "
                                            "received while waiting for rollouts)"), out[-1000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing had finished: nothing written


def _wait_until_caught(proc: subprocess.Popen, sig: signal.Signals, timeout_s: float = 120.0) -> None:
    """Return once ``proc`` has a handler for ``sig`` (Linux: the SigCgt mask in /proc/PID/status). A fixed
    sleep instead raced the interpreter's own start-up on a loaded machine: SIGTERM before any handler kills
    the process with -15, which is Python's default, not the CLI's behaviour under test."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines())
        if int(fields["SigCgt"], 16) >> (sig - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError(f"no {sig.name} handler after {timeout_s} s")


def test_sigterm_while_starting_up_exits_at_once_in_one_line(tmp_path, model_dir):
    proc = subprocess.Popen(_train_cmd(tmp_path, model_dir), cwd=REPO, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    _wait_until_caught(proc, signal.SIGTERM)  # the CLI's start-up handler, then seconds of importing torch
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]  # preempted: SLURM requeues on 0
    assert err.strip().splitlines()[-1] == ("megatron-spo: SIGTERM received while starting up: nothing to save, "
                                            "exiting")


START_UP_HANDLER = ("import signal, sys; sys.path.insert(0, sys.argv[1]); from megatron_spo.cli import exit_while_starting; "
                    "signal.signal(signal.SIGTERM, exit_while_starting); ")
SELF_TERM = "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"


def test_sigterm_inside_an_import_ends_the_process_even_where_a_library_catches_everything(tmp_path):
    # a module whose import catches BaseException (as a library's import guard may): the handler's SystemExit was
    # swallowed there and the process went on with half-made modules (a RecursionError from numpy.linalg, exit 1)
    (tmp_path / "broad.py").write_text(f"import os, signal, time\ntry:\n    {SELF_TERM}\nexcept BaseException:\n"
                                       "    pass\nprint('went on after the signal', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", START_UP_HANDLER + "import broad; print('after the import')",
                           str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert (proc.returncode, proc.stdout) == (0, "")
    assert proc.stderr.strip() == "megatron-spo: SIGTERM received while starting up: nothing to save, exiting"


def test_sigterm_outside_an_import_still_unwinds_so_cleanups_run(tmp_path):
    code = START_UP_HANDLER + f"import os, time\ntry:\n    {SELF_TERM}\nfinally:\n    print('cleaned up')"
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=REPO)
    assert (proc.returncode, proc.stdout.strip()) == (0, "cleaned up")
    assert proc.stderr.strip() == "megatron-spo: SIGTERM received while starting up: nothing to save, exiting"


# -- SGLang's /health while paused -----------------------------------------------------------------------------
class FlakyEngine(LocalEngine):
    """Fails its next ``failures`` weight loads (after receiving them), like a GPU that ran out of memory."""

    failures = 0

    def load_named_tensors(self, named):
        if self.failures:
            self.failures -= 1
            raise RuntimeError("CUDA out of memory (simulated)")
        return super().load_named_tensors(named)


def test_health_blocks_while_paused_then_answers_503_as_sglang_does(model_dir):
    with ServerThread(LocalEngine(model_dir), health_timeout_s=1.0) as srv:
        assert get_json(srv.url + "/health", 5)[0] == 200
        assert post_json(srv.url + "/pause_generation", {"mode": "retract"}, 10)[0] == 200
        t0 = time.monotonic()
        assert get_json(srv.url + "/health", 5)[0] == 503
        assert 1.0 <= time.monotonic() - t0 < 3
        assert get_json(srv.url + "/server_info", 5)[0] == 200  # answered at once while paused
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a /health waiting when generation continues
            waiting = pool.submit(get_json, srv.url + "/health", 5)
            time.sleep(0.3)
            assert post_json(srv.url + "/continue_generation", {}, 10)[0] == 200
            assert waiting.result(5)[0] == 200


def test_a_lagging_engine_is_resynced_with_sglang_health_behaviour(model_dir):
    """An engine that missed a push stays paused; with SGLang's /health (blocks, then 503) the next push must
    still find it (it probes /server_info) and bring it back."""
    import torch

    new_state = perturbed_state_dict(model_dir, seed=21)
    torch.set_num_threads(1)
    with ServerThread(LocalEngine(model_dir, seed=0), health_timeout_s=1.0) as good, \
            ServerThread(FlakyEngine(model_dir, seed=1), health_timeout_s=1.0) as flaky, \
            WeightBroadcaster([good.url, flaky.url], bucket_bytes=20_000) as sync:
        flaky.engine.failures = 1
        report = sync.push(new_state.items(), version="1")
        assert report.engines_updated == [good.url] and list(report.failed) == [flaky.url]
        assert get_json(flaky.url + "/health", 5)[0] == 503  # paused, as real SGLang answers it

        report = sync.push(new_state.items(), version="2")
        assert report.failed == {} and report.engines_updated == [good.url, flaky.url]
        assert report.resynced == [flaky.url] and sync.lagging == {}
        assert all(torch.equal(t, new_state[n]) for n, t in flaky.engine.model.state_dict().items())
        assert get_json(flaky.url + "/health", 5)[0] == 200
        status, item = post_json(flaky.url + "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}})
        assert status == 200 and item["meta_info"]["weight_version"] == "2"


def test_a_restarted_engine_is_found_by_the_next_push_and_gets_it_all_in_a_new_group(model_dir):
    """An engine restarted on its port between two pushes (it never missed one: the group's members did not change)
    reports its launch weight_version: needs_weights() names it, and the next push counts it restarted, forms the
    broadcast group anew (the old one died with the old process) and brings it to the pushed weights."""
    import torch

    new_state = perturbed_state_dict(model_dir, seed=23)
    torch.set_num_threads(1)
    with ServerThread(LocalEngine(model_dir, seed=0)) as good:
        # bound by the server itself (SO_REUSEADDR, as an engine process binds): its port is free again at once
        first = ServerThread(LocalEngine(model_dir, seed=1), port=free_port()).__enter__()
        url = first.url
        with WeightBroadcaster([good.url, url], bucket_bytes=20_000) as sync:
            try:
                assert sync.push(new_state.items(), version="1").engines_updated == [good.url, url]
                assert sync.needs_weights() == []
                group = sync.group_name
            finally:
                first.__exit__(None, None, None)  # the engine goes (a kill), then comes back on its port
            assert sync.needs_weights() == []  # nothing answers there: no push could reach it
            with ServerThread(LocalEngine(model_dir, seed=1), port=first.port) as again:
                assert get_json(url + "/model_info", 5)[1]["weight_version"] == "default"
                assert sync.needs_weights() == [url]
                report = sync.push(new_state.items(), version="2")
                assert report.engines_updated == [good.url, url] and report.failed == {}
                assert report.restarted == [url] and report.resynced == [url] and sync.group_name != group
                assert report.metrics()["fleet/engine_restarts"] == 1.0
                assert report.metrics()["weight_sync/engines_restarted"] == 1.0
                assert all(torch.equal(t, new_state[n]) for n, t in again.engine.model.state_dict().items())
                assert sync.needs_weights() == []
                report = sync.push(new_state.items(), version="3")  # nothing restarted since: the same group
                assert report.restarted == [] and report.metrics()["fleet/engine_restarts"] == 1.0


def test_the_first_push_finds_an_engine_a_stopped_run_left_paused(model_dir):
    """A resumed trainer's first push waits for the engines; one that a stopped run's push left paused answers
    /health 503 (SGLang) for ever, so the wait asks /model_info and the push resyncs it."""
    new_state = perturbed_state_dict(model_dir, seed=3)
    with ServerThread(LocalEngine(model_dir), health_timeout_s=0.5) as srv:
        assert post_json(srv.url + "/pause_generation", {"mode": "retract"}, 10)[0] == 200
        source = source_on(srv.url, engine_wait_s=4.0)
        source.broadcaster = WeightBroadcaster([srv.url], bucket_bytes=20_000)
        try:
            metrics = source.push_weights(1, iter(new_state.items()))
        finally:
            source.broadcaster.close()
            source.broadcaster = None
            source.close()
        assert metrics["weight_sync/engines_updated"] == 1.0 and metrics["weight_sync/failed"] == 0.0
        assert get_json(srv.url + "/health", 5)[0] == 200  # continued: serving the new weights


def test_sigterm_during_a_push_to_a_hung_engine_ends_it_within_the_grace(model_dir, tmp_path):
    """An engine that never answers /pause_generation (30 s) held a stopping trainer for the call's timeout
    (600 s): after SIGTERM the push waits STOP_GRACE_S (5 s) for answers and counts the hung engine as failed
    (left paused, resynced by a later push). Here it is the only engine: the push reached none, and the source
    stops (Stopped) instead of letting the trainer send it again."""
    from rollout_helpers import FaultyServer

    from megatron_spo.rollout import weight_sync

    new_state = perturbed_state_dict(model_dir, seed=4)
    handler = PreemptionHandler()
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
    with ServerThread(LocalEngine(model_dir)) as good, FaultyServer("slow") as hung:
        hung_url = f"http://127.0.0.1:{hung.server.server_address[1]}"
        source = source_on(good.url)
        source._fleet_seen_healthy = True
        try:
            source.broadcaster = WeightBroadcaster([good.url, hung_url], mode="disk", disk_dir=str(tmp_path / "a"))
            timer.start()
            t0 = time.monotonic()
            metrics = source.push_weights(1, iter(new_state.items()))  # the good engine took it: no Stopped
            seconds = time.monotonic() - t0
            source.broadcaster.close()
            assert metrics["weight_sync/engines_updated"] == 1.0 and metrics["weight_sync/engines_failed"] == 1.0
            assert source.broadcaster.lagging == {hung_url: "/pause_generation: no answer before the trainer "
                                                            "stopped (SIGTERM)"}
            source.broadcaster = WeightBroadcaster([hung_url], mode="disk", disk_dir=str(tmp_path / "b"))
            with pytest.raises(Stopped, match="^SIGTERM received while waiting for the weight push$"):
                source.push_weights(2, iter(new_state.items()))  # reached no engine: stop, do not send again
            source.broadcaster.close()
        finally:
            timer.cancel()
            handler.restore()
            source.broadcaster = None
            source.close()
        assert weight_sync.STOP_GRACE_S <= seconds < weight_sync.STOP_GRACE_S + 4, seconds
        assert get_json(good.url + "/model_info", 5)[1]["weight_version"] == "1"
        assert all(torch_equal(t, new_state[n]) for n, t in good.engine.model.state_dict().items())


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


def test_the_router_keeps_workers_through_a_paused_push():
    """Fleet's sglang-router thresholds: a worker is marked unhealthy only after minutes of failed /health
    (SGLang's blocks 20 s while paused), not after one failure as with --health-failure-threshold 1."""
    from megatron_spo.rollout.fleet import Fleet, RouterHealth

    health = RouterHealth()
    assert health.timeout_s > 20 and health.tolerated_pause_s() >= 300
    fleet = Fleet(None, 2, engine_command="true {port}", router_health=RouterHealth(failures=20))  # not started
    cmd = fleet.router.command
    assert cmd[cmd.index("--health-failure-threshold") + 1] == "20"
    assert cmd[cmd.index("--health-check-timeout-secs") + 1] == str(health.timeout_s)


# -- a signal after a step finished: the step is checkpointed, every rank stops together ------------------------
class StopsOnThirdTake:
    """An online source that gives two batches, then ends the wait for the third as a SIGTERM does."""

    def __init__(self):
        from trainer_helpers import DeterministicSource

        self.inner, self.takes = DeterministicSource(), 0

    def take(self, k: int, timeout_s: float | None = None) -> list:
        self.takes += 1
        if self.takes == 3:
            raise Stopped("SIGTERM received while waiting for rollouts")
        return self.inner.take(k)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def train_until_stopped(cfg_data: dict, out_file: str) -> None:
    """One rank: train with StopsOnThirdTake on rank 0; each rank writes the step it ended at and the latest
    checkpoint (a rank that did not learn of the stop would hang in the batch broadcast)."""
    import json

    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    trainer = Trainer(TrainConfig.model_validate(cfg_data), online_source=StopsOnThirdTake())
    try:
        step = trainer.train()
    finally:
        trainer.close()
    latest = trainer.ckpt.latest()
    with open(f"{out_file}.{trainer.rank}", "w") as f:
        json.dump({"step": step, "latest": latest[0] if latest else None}, f)


@pytest.mark.slow
@pytest.mark.multiproc
def test_a_stop_after_a_finished_step_checkpoints_it_and_every_rank_exits(tmp_path, capfd):
    import json

    from trainer_helpers import make_tiny_hf

    from megatron_spo.models.parallel import spawn_local

    hf = make_tiny_hf(str(tmp_path / "hf"))
    cfg = dict(run_dir=str(tmp_path / "run"), steps=5, algo="grpo", beta=0.5, init={"hf": hf},
               optimizer={"lr": 1e-3, "warmup_steps": 2}, rollout={"temperature_range": [1.0, 1.0], "top_p": 1.0},
               batch={"sequences_per_step": 8, "max_tokens_per_micro_batch": 64, "max_seq_length": 64},
               model_update_interval=1, checkpoint={"interval": 100, "export_hf": False}, logging={"progress": False})
    spawn_local(train_until_stopped, 2, cfg, str(tmp_path / "result"))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"result.{rank}").read_text()) == {"step": 2, "latest": 2}
    assert ("[megatron-spo] preempted: checkpoint at step 2 saved, exiting (SIGTERM received while waiting for "
            "rollouts)" in capfd.readouterr().out)


# -- an engine killed (kill -9) mid-run comes back ---------------------------------------------------------------
def train_through_an_engine_kill(cfg_data: dict, model_dir: str, out_file: str, kill_at_step: int = 2,
                                 back_by_step: int = 4) -> None:
    """One rank, two real engines behind the router (rollout/fleet.py's supervisor restarts what dies): engine 1 is
    SIGKILLed while it holds a request generated after step ``kill_at_step``'s take; step ``back_by_step`` waits
    (deadline) until its restart answers, so the pushes from there on must reach it. Writes what the test checks."""
    import json

    from rollout_helpers import engine_env

    from megatron_spo.rollout.fleet import EngineWatch, Fleet
    from megatron_spo.training.config import TrainConfig
    from megatron_spo.training.trainer import Trainer

    with Fleet(model_dir, 2, env=engine_env(), log_dir=os.path.join(cfg_data["run_dir"], "fleet"),
               watch=EngineWatch(max_restarts=2)) as fleet:
        cfg_data["fleet"] = {"engine_urls": fleet.engine_urls, "router_url": fleet.router_url}
        trainer = Trainer(TrainConfig.model_validate(cfg_data))
        manager = trainer.online.manager
        victim = manager.endpoints[1]
        kill_now, in_flight, killed = threading.Event(), threading.Event(), threading.Event()
        generate = victim.client.generate

        async def generate_on_victim(*args, **kw):  # the kill lands while this request is on engine 1
            if kill_now.is_set():
                in_flight.set()
            return await generate(*args, **kw)

        victim.client.generate = generate_on_victim

        def killer() -> None:
            if in_flight.wait(600):
                os.kill(fleet.engines[1].proc.pid, signal.SIGKILL)
                killed.set()

        threading.Thread(target=killer, daemon=True).start()
        take, batches = trainer.online.take, []

        def recording_take(k, timeout_s=None):
            if len(batches) == kill_at_step - 1:
                kill_now.set()
            if len(batches) == back_by_step - 1:  # restarted and answering: this step's push must reach it
                deadline = time.monotonic() + 180
                while fleet.engines[1].restarts < 1 or fleet.engines[1].state not in ("needs_weights", "serving"):
                    assert time.monotonic() < deadline, f"engine 1 not back: {fleet.engines[1].state}"
                    time.sleep(0.1)
            batch = take(k, timeout_s)
            if len(batches) == kill_at_step - 1:  # the take made room in the buffer: the workers generate, engine 1 too
                assert killed.wait(120), "engine 1 got no request to be killed in"
            batches.append([[t.request_id, t.sample_index, t.prompt_id, list(t.response_tokens), t.policy_version]
                            for t in batch])
            return batch

        trainer.online.take = recording_take
        trainer.sampler.sources["online"].take = recording_take
        try:
            trainer.train()
            stats = trainer.online.stats()
            deadline = time.monotonic() + 60  # the supervisor re-admits it once it reports the pushed version
            while fleet.engines[1].state != "serving" and time.monotonic() < deadline:
                time.sleep(0.1)
            result = {"batches": batches, "policy_version": trainer.policy_version, "stats": stats,
                      "versions": list(fleet.engine_versions().values()), "fleet": fleet.metrics(),
                      "restarts": [e.restarts for e in fleet.engines], "state": fleet.engines[1].state,
                      "routed": sorted(fleet.router_workers()), "urls": fleet.engine_urls}
        finally:
            trainer.close()
    with open(out_file, "w") as f:
        json.dump(result, f)


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_engine_killed_mid_run_is_restarted_resynced_and_no_trajectory_is_lost_or_doubled(tmp_path, model_dir,
                                                                                               monkeypatch):
    """kill -9 of one of two engines in the middle of a CPU run (the trainer with real local engines): its request
    is retried on the other engine, the fleet restarts it on its port, the next push finds it restarted (a new
    broadcast group) and brings it to the current weights; the run finishes all its steps with both engines at the
    final version, the restarted one back in the router; every trained trajectory is one sample of one request,
    none failed or delivered twice, and the experience archive holds exactly the trained ones."""
    import json

    from megatron_spo.data.offline_store import OfflineStore
    from megatron_spo.models.parallel import spawn_local

    monkeypatch.chdir(REPO)  # examples.custom_reward (no sandbox)
    steps, per_step = 5, 4
    cfg = dict(run_dir=str(tmp_path / "run"), steps=steps, algo="grpo", init={"hf": model_dir},
               optimizer={"lr": 1e-3, "warmup_steps": 1}, model_update_interval=1,
               task={"kind": "toy", "reward": "examples.custom_reward:fenced_code", "limit": 4,
                     "max_prompt_tokens": 400},
               batch={"sequences_per_step": per_step, "max_tokens_per_micro_batch": 1024, "max_seq_length": 512},
               rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "buffer_groups": 4, "max_inflight_requests": 4,
                        "temperature_range": [1.0, 1.0], "top_p": 1.0, "retry_backoff_s": 0.1,
                        "retry_backoff_max_s": 0.5, "endpoint_cooldown_s": 0.5, "max_retries": 20},
               checkpoint={"interval": 100, "export_hf": False}, logging={"progress": False})
    spawn_local(train_through_an_engine_kill, 1, cfg, model_dir, str(tmp_path / "result.json"))
    result = json.loads((tmp_path / "result.json").read_text())

    assert result["policy_version"] == steps  # a push after every step
    assert result["versions"] == [str(steps)] * 2  # the restarted engine holds the final weights too
    assert result["restarts"] == [0, 1] and result["state"] == "serving"
    assert result["routed"] == sorted(result["urls"])  # back in the router once it held them
    assert result["fleet"]["fleet/engine_restarts"] == 1.0 and result["fleet"]["fleet/engines_serving"] == 2.0
    stats = result["stats"]
    assert stats["rollout/retries"] >= 1  # what was sent to the killed engine went to the other one
    assert stats["rollout/failed_requests"] == 0 and stats["rollout/duplicates_dropped"] == 0

    trained = [row for batch in result["batches"] for row in batch]
    assert len(result["batches"]) == steps and all(len(b) == per_step for b in result["batches"])
    assert len({(r[0], r[1]) for r in trained}) == steps * per_step  # no sample trained twice
    archived = OfflineStore(tmp_path / "run" / "experience").trajectories()
    key = lambda prompt_id, tokens, version: (str(prompt_id), tuple(tokens), int(version))  # noqa: E731
    assert sorted(key(t.prompt_id, t.response_tokens, t.policy_version) for t in archived) == sorted(
        key(*r[2:]) for r in trained)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert max(m.get("fleet/engine_restarts", 0.0) for m in metrics) == 1.0  # the trainer's pushes saw it restarted
    assert max(m.get("weight_sync/engines_resynced", 0.0) for m in metrics) >= 1.0


@pytest.mark.slow
@pytest.mark.multiproc
def test_an_engine_restarted_between_scheduled_pushes_gets_the_weights_early_and_serves_again(tmp_path, model_dir,
                                                                                              monkeypatch):
    """The same kill -9 in an SPO run pushing every 5 steps, after the push of step 5: the restarted engine answers
    with the initial weights, not version 1, from step 7, so the probe for engines behind brings the next push forward
    (to step 7, 8 or 9: the probe runs beside the steps) instead of leaving it out of the router until step 10; that push
    and the scheduled one reach both engines, and the run ends with both at the final version and no trajectory lost
    or doubled."""
    import json

    from trainer_helpers import toy_q0_file

    from megatron_spo.models.parallel import spawn_local

    monkeypatch.chdir(REPO)
    steps, per_step = 10, 4
    cfg = dict(run_dir=str(tmp_path / "run"), steps=steps, algo="spo", init={"hf": model_dir},
               optimizer={"lr": 1e-3, "warmup_steps": 1}, model_update_interval=5,
               task={"kind": "toy", "reward": "examples.custom_reward:fenced_code", "limit": 4,
                     "max_prompt_tokens": 400, "q0_path": toy_q0_file(tmp_path, limit=4)},
               batch={"sequences_per_step": per_step, "max_tokens_per_micro_batch": 1024, "max_seq_length": 512},
               rollout={"samples_per_prompt": 2, "max_new_tokens": 8, "buffer_groups": 4, "max_inflight_requests": 4,
                        "temperature_range": [1.0, 1.0], "top_p": 1.0, "retry_backoff_s": 0.1,
                        "retry_backoff_max_s": 0.5, "endpoint_cooldown_s": 0.5, "max_retries": 20},
               checkpoint={"interval": 100, "export_hf": False}, logging={"progress": False})
    spawn_local(train_through_an_engine_kill, 1, cfg, model_dir, str(tmp_path / "result.json"), 6, 7)
    result = json.loads((tmp_path / "result.json").read_text())
    metrics = {m["step"]: m for m in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    pushed = [step for step, m in metrics.items() if "weight_sync/engines_updated" in m]
    assert len(pushed) == 3 and pushed[0] == 5 and pushed[1] in (7, 8, 9) and pushed[2] == 10, pushed  # the schedule kept
    early = metrics[pushed[1]]
    assert early["weight_sync/early_pushes"] == 1.0 and early["weight_sync/engines_updated"] == 2.0, early
    assert metrics[10]["weight_sync/early_pushes"] == 1.0  # the run's total: no other push was brought forward
    assert metrics[5]["weight_sync/engines_updated"] == metrics[10]["weight_sync/engines_updated"] == 2.0
    assert result["policy_version"] == 3 and result["versions"] == ["3", "3"] and result["restarts"] == [0, 1]
    assert result["state"] == "serving" and result["routed"] == sorted(result["urls"])
    trained = [row for batch in result["batches"] for row in batch]
    assert len(trained) == steps * per_step == len({(r[0], r[1]) for r in trained})
    assert result["stats"]["rollout/failed_requests"] == 0 and result["stats"]["rollout/duplicates_dropped"] == 0
