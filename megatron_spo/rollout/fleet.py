"""N generation engines behind the real sglang-router, started, health-checked and torn down together.

    megatron-spo fleet up --model HF_DIR --engines 2 --router-port 30000

Engines are the local engine (``megatron-spo serve``) by default, or any command template, e.g. real
SGLang servers on a GPU node: ``--engine-command "python -m sglang.launch_server --model-path {model}
--host {host} --port {port}"``. Every child runs in its own process group and gets SIGTERM if this
process dies (PR_SET_PDEATHSIG), so neither Ctrl-C, SIGTERM nor a crash leaves a process behind.

Also a context manager, for the trainer and tests:

    with Fleet("tiny_dir", num_engines=2) as fleet:
        client = EngineClient(fleet.router_url)

Engines that come back (EngineWatch): an engine whose process exits, or that fails its health checks N times in a
row, leaves the router at once and is started again on its port, up to max_restarts times (then dropped, in one
line); it rejoins the router once it holds the weight version the engines in service hold (the trainer's next push
reaches it: pushes go to every engine directly, weight_sync.py). The router is restarted the same way.
`fleet rejoin` and `fleet watch` do the same for engines another launcher starts (slurm/launch_workers.sh).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from megatron_spo.net import free_port
from megatron_spo.rollout.client import get_json, post_json, wait_healthy

log = logging.getLogger("megatron_spo.fleet")

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the process that started it exits (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class FleetError(RuntimeError):
    pass


PORT_TRIES = 3  # starts of one process whose probed port another process took before it bound


def _port_in_use(host: str, port: int) -> bool:
    """Whether another socket holds ``port`` on ``host`` (a listener or a connection's end; TIME_WAIT does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


@dataclass(frozen=True)
class RouterHealth:
    """sglang-router's checks of its workers' /health. SGLang's /health runs a one-token generation, so
    during a weight push's pause it blocks and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s): a
    worker is marked unhealthy only after ``failures`` checks in a row fail, about
    failures x (interval_s + timeout_s) = 12 x 35 s = 7 min of pause, longer than a push of 70B weights.
    (A worker whose process exits is taken out at once by Fleet's own watcher, not by these checks.)"""

    interval_s: int = 5
    timeout_s: int = 30  # above SGLang's 20 s, so a paused engine's own 503 is what the router sees
    failures: int = 12
    successes: int = 1  # back in service at the first good answer after the push

    def tolerated_pause_s(self) -> float:
        return self.failures * (self.interval_s + self.timeout_s)

    def args(self) -> list[str]:
        return ["--health-check-interval-secs", str(self.interval_s), "--health-check-timeout-secs",
                str(self.timeout_s), "--health-failure-threshold", str(self.failures),
                "--health-success-threshold", str(self.successes)]


@dataclass(frozen=True)
class EngineWatch:
    """The fleet's own checks of its engines: GET /health every ``interval_s``; ``failures`` checks in a row that fail
    (or take over ``timeout_s``) mean it stopped answering. An engine that exits or stops answering is restarted on its
    port, at most ``max_restarts`` times (0: dropped at once). The defaults tolerate a weight push's pause as the
    router's checks do (RouterHealth: SGLang's /health blocks while paused)."""

    interval_s: float = RouterHealth.interval_s
    timeout_s: float = RouterHealth.timeout_s
    failures: int = RouterHealth.failures
    max_restarts: int = 3

    def __post_init__(self):
        if self.interval_s <= 0 or self.timeout_s <= 0 or self.failures < 1 or self.max_restarts < 0:
            raise FleetError(f"fleet: bad engine watch {self}: intervals > 0, failures >= 1, max_restarts >= 0")


POLL_S = 0.5  # the supervisor's tick: a process that exited is seen within it


@dataclass
class ManagedProcess:
    name: str
    command: list[str]
    url: str
    proc: subprocess.Popen | None = None
    side_ports: tuple[int, ...] = ()  # other ports the fleet probed for it (the router's metrics exporter)
    state: str = "serving"  # serving | starting (restarted) | needs_weights (restarted, up) | dropped
    restarts: int = 0
    failures: int = 0  # health checks failed in a row
    version: str | None = None  # weight_version it last reported
    since: float = 0.0  # when it entered its state
    next_check: float = 0.0

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Fleet:
    """Start ``num_engines`` engines (ports base_port.., default: free ports) and sglang-router."""

    def __init__(self, model_dir: str | None = None, num_engines: int = 1, *, router_port: int | None = None,
                 host: str = "127.0.0.1", engine_ports: list[int] | None = None, engine_command: str | None = None,
                 engine_args: list[str] | None = None, router: bool = True, router_args: list[str] | None = None,
                 threads_per_engine: int | None = 1, startup_timeout_s: float = 300.0, log_dir: str | None = None,
                 env: dict | None = None, router_health: RouterHealth | None = None, watch: EngineWatch | None = None):
        if num_engines < 1:
            raise FleetError(f"fleet: --engines must be >= 1, got {num_engines}")
        if engine_command is None and (model_dir is None or not os.path.isdir(model_dir)):
            raise FleetError(f"fleet: model directory '{model_dir}' does not exist")
        if engine_ports is not None and len(engine_ports) != num_engines:
            raise FleetError(f"fleet: {len(engine_ports)} engine ports for {num_engines} engines")
        self.model_dir, self.host = model_dir, host
        self.startup_timeout_s, self.log_dir = startup_timeout_s, log_dir
        self.env = dict(os.environ if env is None else env)
        if threads_per_engine:
            self.env.update(OMP_NUM_THREADS=str(threads_per_engine), MKL_NUM_THREADS=str(threads_per_engine))
        self._engine_spec = (engine_command, engine_args or [], threads_per_engine)
        self._engine_ports_chosen = engine_ports is None  # probed here: moved if taken before the engine binds
        ports = engine_ports or [free_port() for _ in range(num_engines)]
        self.engines = [self._engine(i, port) for i, port in enumerate(ports)]
        self.router: ManagedProcess | None = None
        self._watcher: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.RLock()  # router membership: the supervisor and sync_weights
        self.watch = watch or EngineWatch()
        self.restarts = 0  # engine restarts so far (fleet/engine_restarts)
        self.router_restarts = 0
        self.weight_version: str | None = None  # the newest weight_version seen in service
        # the first membership check one interval after the start (the router starts with every engine): a quiet
        # watch's checks then really sleep, and a `fleet rejoin` of another launcher is not undone at once
        self._next_reconcile = time.monotonic() + self.watch.interval_s
        self._router_spec = (router_health or RouterHealth(), router_args or [])
        self._router_port_chosen = router_port is None
        if router:
            self.router = self._router(router_port or free_port())

    def _engine(self, i: int, port: int) -> ManagedProcess:
        template, extra, threads = self._engine_spec
        return ManagedProcess(f"engine{i}", self._engine_command(template, extra, port, threads),
                              f"http://{self.host}:{port}")

    def _router(self, port: int, urls: list[str] | None = None) -> ManagedProcess:
        health, extra = self._router_spec
        cmd = [sys.executable, "-m", "megatron_spo.cli", "router", "--host", self.host, "--port", str(port),
               "--worker-urls", *(self.engine_urls if urls is None else urls), "--policy", "round_robin",
               "--log-level", "warn", *health.args(),
               "--worker-startup-timeout-secs", str(int(self.startup_timeout_s)),
               # its metrics exporter binds a fixed default port: a second router on the host would panic
               "--prometheus-host", self.host, "--prometheus-port", str(metrics_port := free_port()), *extra]
        return ManagedProcess("router", cmd, f"http://{self.host}:{port}", side_ports=(metrics_port,))

    def _engine_command(self, template: str | None, extra: list[str], port: int, threads: int | None) -> list[str]:
        if template is not None:
            return shlex.split(template.format(model=self.model_dir, host=self.host, port=port))
        cmd = [sys.executable, "-m", "megatron_spo.cli", "serve", "--model", self.model_dir, "--host", self.host,
               "--port", str(port), "--log-level", "warning"]
        if threads:
            cmd += ["--threads", str(threads)]
        return cmd + extra

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def engine_urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def router_url(self) -> str:
        if self.router is None:
            raise FleetError("fleet started without a router")
        return self.router.url

    def _spawn(self, mp: ManagedProcess) -> None:
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{mp.name}.log"), "ab")  # noqa: SIM115 (child owns it)
        mp.proc = subprocess.Popen(mp.command, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                   start_new_session=True, preexec_fn=_die_with_parent)
        if out is not None:
            out.close()
        log.info("started %s (pid %d): %s", mp.name, mp.proc.pid, " ".join(mp.command))

    def start(self) -> Fleet:
        try:
            for engine in self.engines:
                self._spawn(engine)
            urls = self.engine_urls
            for i in range(len(self.engines)):
                self.engines[i] = self._healthy_or_moved(self.engines[i], self._engine_ports_chosen,
                                                         lambda port, i=i: self._engine(i, port))
            if self.router is not None:
                if self.engine_urls != urls:  # an engine moved: the router is given its new URL
                    self.router = self._router(int(self.router.url.rsplit(":", 1)[1]))
                self._spawn(self.router)
                self.router = self._healthy_or_moved(self.router, self._router_port_chosen, self._router)
                self.wait_router_workers(len(self.engines))
            self._watcher = threading.Thread(target=self._watch, name="fleet-watch", daemon=True)
            self._watcher.start()
        except BaseException:
            self.stop()
            raise
        return self

    # --- the supervisor: engines (and the router) that come back -------------------------------------
    def _watch(self) -> None:
        """Every POLL_S: see exits and health answers, restart what was lost, re-admit what caught up. Health calls
        run on a pool, so one hung engine delays nothing else."""
        pool = concurrent.futures.ThreadPoolExecutor(len(self.engines) + 1, thread_name_prefix="fleet-health")
        pending: dict[int, concurrent.futures.Future] = {}
        try:
            while not self._stopping.wait(POLL_S):
                try:
                    self._supervise(pool, pending)
                except Exception:  # the supervisor outlives any one failure
                    log.exception("fleet supervisor")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _supervise(self, pool, pending: dict) -> None:
        for i, e in enumerate(self.engines):
            if self._stopping.is_set():
                return
            with self._lock:  # restart_engine and sync_weights change engines too
                fut = pending.get(i)
                if fut is not None and fut.done():
                    del pending[i]
                    if e.state != "dropped" and e.alive:
                        self._answered(i, *fut.result())
                now = time.monotonic()
                if e.state == "dropped":
                    continue
                if not e.alive:
                    self._lost(i, f"exited with code {e.proc.returncode if e.proc else None}")
                    pending.pop(i, None)
                elif e.state == "starting" and now - e.since > self.startup_timeout_s:
                    self._lost(i, f"was not healthy {self.startup_timeout_s:g} s after its restart")
                    pending.pop(i, None)
                elif i not in pending and now >= e.next_check:
                    # an engine back from a restart is judged against what the engines in service hold now
                    peers = [p.url for p in self.serving() if p is not e] if e.state != "serving" else []
                    pending[i] = pool.submit(_probe, e.url, self.watch.timeout_s, peers)
                    e.next_check = now + (self.watch.interval_s if e.state == "serving" else POLL_S)
        self._supervise_router()

    def _answered(self, i: int, healthy: bool, version: str | None, in_service: str | None) -> None:
        """One health probe's answer: count failures of an engine in service, move a restarted one along (it serves
        once it holds ``in_service``, the newest version its peers in service report now)."""
        e = self.engines[i]
        if healthy:
            e.failures, e.version = 0, version
        if e.state == "serving" and healthy:
            self._saw_version(version)
            return
        if not healthy and e.state != "starting":  # loading weights after a restart is not judged (startup_timeout_s)
            e.failures += 1
            if e.failures >= self.watch.failures:
                self._lost(i, f"stopped answering ({e.failures} health checks in a row failed)")
            return
        if e.state == "serving":
            return
        self._saw_version(in_service)
        current = in_service if in_service is not None else self.weight_version  # none in service: the last seen
        if e.state == "starting" and healthy:
            e.state, e.since = "needs_weights", time.monotonic()
            log.info("%s at %s is up again; it rejoins the router once it holds weight version %s", e.name, e.url,
                     current or "(any: none known)")
        if e.state == "needs_weights" and healthy and caught_up(version, current):
            self._rejoin(i)

    def _saw_version(self, version: str | None) -> None:
        if version is not None and caught_up(version, self.weight_version):
            self.weight_version = version

    def _rejoin(self, i: int) -> None:
        e = self.engines[i]
        with self._lock:
            if self.router is not None:
                try:
                    self.router_add(e.url, timeout_s=10.0)
                except (OSError, FleetError) as err:  # the router is down or busy: tried again at the next answer
                    log.debug("%s at %s: not re-added to the router yet: %s", e.name, e.url, err)
                    return
            e.state, e.since = "serving", time.monotonic()
        log.info("%s at %s back in service at weight version %s (restart %d of %d)%s", e.name, e.url, e.version,
                 e.restarts, self.watch.max_restarts, self._tally())

    def _lost(self, i: int, why: str) -> None:
        """Engine ``i`` exited or stopped answering: out of the router, killed, restarted on its port or dropped."""
        e = self.engines[i]
        with self._lock:
            if self.router is not None and self.router.alive:
                try:
                    self.router_remove(e.url)
                except (OSError, FleetError) as err:
                    log.error("could not remove %s from the router: %s", e.url, err)
        _signal_group(e.proc, signal.SIGKILL)  # a hung engine, and what is left of its process group
        if e.proc is not None:
            try:
                e.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL", e.name, e.proc.pid)
        e.failures, e.version = 0, None
        if e.restarts >= self.watch.max_restarts or self._stopping.is_set():
            e.state = "dropped"
            log.error("%s at %s %s: dropped after %d restarts (max_restarts); the fleet goes on with %d of %d engines",
                      e.name, e.url, why, e.restarts, len(self.serving()), len(self.engines))
            return
        e.state, e.since, e.next_check = "starting", time.monotonic(), 0.0
        e.restarts += 1
        self.restarts += 1
        log.error("%s at %s %s: restarting it on its port (restart %d of %d)%s", e.name, e.url, why, e.restarts,
                  self.watch.max_restarts, self._tally())
        try:
            self._spawn(e)
        except OSError as err:
            e.state = "dropped"
            log.error("%s: could not be started again (%s): dropped", e.name, err)
            return
        e.since = time.monotonic()

    def _supervise_router(self) -> None:
        """A router that exits is started again on its port over the engines in service, within max_restarts. A live
        one is checked every interval_s against the fleet's view: what serves is routed to, nothing else."""
        r = self.router
        if r is None or r.proc is None or r.state == "dropped" or self._stopping.is_set():
            return
        if r.alive:
            if time.monotonic() >= self._next_reconcile:
                self._next_reconcile = time.monotonic() + self.watch.interval_s
                self._reconcile_router()
            return
        code = r.proc.returncode
        if self.router_restarts >= self.watch.max_restarts:
            r.state = "dropped"
            log.error("router at %s exited with code %s: dropped after %d restarts (max_restarts)", r.url, code,
                      self.router_restarts)
            return
        self.router_restarts += 1
        with self._lock:
            self.router = self._router(int(r.url.rsplit(":", 1)[1]), [e.url for e in self.serving()])
            log.error("router at %s exited with code %s: restarting it over %d engines (restart %d of %d)", r.url,
                      code, len(self.serving()), self.router_restarts, self.watch.max_restarts)
            self._spawn(self.router)

    def _reconcile_router(self) -> None:
        with self._lock:
            try:
                listed = set(self.router_workers())
                for e in self.engines:
                    if e.state == "serving" and e.alive and e.url not in listed:
                        log.warning("%s at %s serves but the router does not list it: adding it again", e.name, e.url)
                        self.router_add(e.url, timeout_s=10.0)
                    elif e.state != "serving" and e.url in listed:
                        self.router_remove(e.url)
            except (OSError, FleetError) as err:  # a router (re)starting or busy: the next check tries again
                log.debug("router membership check: %s", err)

    def serving(self) -> list[ManagedProcess]:
        return [e for e in self.engines if e.state == "serving" and e.alive]

    def metrics(self) -> dict[str, float]:
        """fleet/engine_restarts (so far), fleet/engines_serving, fleet/engines_needing_weights (restarted, not yet
        at the current weights), fleet/engines_dropped, fleet/router_restarts."""
        states = [e.state for e in self.engines]
        return {"fleet/engine_restarts": float(self.restarts), "fleet/engines_serving": float(len(self.serving())),
                "fleet/engines_needing_weights": float(states.count("needs_weights") + states.count("starting")),
                "fleet/engines_dropped": float(states.count("dropped")),
                "fleet/router_restarts": float(self.router_restarts)}

    def _tally(self) -> str:
        m = self.metrics()
        return (f" [fleet/engine_restarts {m['fleet/engine_restarts']:g}, serving {m['fleet/engines_serving']:g} of "
                f"{len(self.engines)}]")

    def _healthy_or_moved(self, mp: ManagedProcess, port_chosen: bool, rebuild) -> ManagedProcess:
        """Wait for ``mp``'s /health. A process that exits before it is healthy while a port this fleet probed for
        it is bound by someone else lost a race for the port (another process took it between the probe and the
        bind): start it again on new ports (its own only if the fleet chose it), up to PORT_TRIES times. Returns
        the process that became healthy."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self.wait_healthy(mp)
                return mp
            except FleetError:
                port = int(mp.url.rsplit(":", 1)[1])
                taken = [p for p in ((port,) if port_chosen else ()) + mp.side_ports if _port_in_use(self.host, p)]
                if mp.alive or attempt == PORT_TRIES or not taken:
                    raise
                moved = rebuild(free_port() if port_chosen else port)
                log.warning("%s: port %s was taken before it could bind; starting it again as %s", mp.name,
                            " and ".join(map(str, taken)), moved.url)
                mp = moved
                self._spawn(mp)
        raise AssertionError("unreachable")

    def wait_healthy(self, mp: ManagedProcess, timeout_s: float | None = None) -> None:
        def dead(_url: str) -> str | None:
            if mp.alive:
                return None
            return (f"{mp.name} exited with code {mp.proc.returncode if mp.proc else None} before becoming "
                    f"healthy ({' '.join(mp.command)})")

        try:
            wait_healthy([mp.url], timeout_s or self.startup_timeout_s, poll_s=0.2, what=mp.name, dead=dead)
        except RuntimeError as err:
            raise FleetError(str(err)) from None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left after grace_s."""
        self._stopping.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=15)
        procs = [p for p in [self.router, *self.engines] if p is not None and p.proc is not None]
        for mp in procs:
            _signal_group(mp.proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for mp in procs:
            try:
                mp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            _signal_group(mp.proc, signal.SIGKILL)  # also reaps any grandchild left in the group
            try:
                mp.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log.error("%s (pid %d) survived SIGKILL", mp.name, mp.proc.pid)

    def __enter__(self) -> Fleet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- faults and membership -------------------------------------------------------------------
    def dead_engines(self) -> list[int]:
        return [i for i, e in enumerate(self.engines) if e.proc is not None and e.proc.poll() is not None]

    def kill_engine(self, index: int, sig: int = signal.SIGKILL) -> None:
        engine = self.engines[index]
        _signal_group(engine.proc, sig)
        engine.proc.wait(timeout=30)

    def restart_engine(self, index: int) -> str:
        """Start engine ``index`` again on its port (out of the router first) and wait for /health. It rejoins the
        router once it holds the weight version in service (the supervisor re-adds it; sync_weights brings it there)."""
        engine = self.engines[index]
        with self._lock:
            if engine.alive:
                raise FleetError(f"{engine.name} is still running")
            if self.router is not None and self.router.alive:
                self.router_remove(engine.url)
            engine.restarts += 1
            self.restarts += 1
            self._spawn(engine)
            engine.state, engine.since, engine.next_check = "starting", time.monotonic(), 0.0
        self.wait_healthy(engine)
        with self._lock:
            if engine.state == "starting":
                engine.state, engine.since = "needs_weights", time.monotonic()
        return engine.url

    def engine_versions(self) -> dict[str, str | None]:
        """url -> weight_version reported by each live engine (None when it does not answer)."""
        return {e.url: engine_version(e.url) if e.alive else None for e in self.engines}

    def sync_weights(self, broadcaster, named_tensors, version: str) -> list[str]:
        """Bring every live engine to ``version`` (one push) and route only to engines that have it.

        Engines outside the router (restarted) join the push and are added back once they hold the version;
        engines that missed it leave the router (the supervisor re-admits them once a push reaches them). Returns
        the urls left lagging."""
        from megatron_spo.rollout.weight_sync import WeightSyncError

        version = str(version)
        with self._lock:
            live = [e for e in self.engines if e.alive]
            routed = set(self.router_workers()) if self.router is not None else {e.url for e in live}
            try:
                broadcaster.push(named_tensors, version, engines=[e.url for e in live])
            except WeightSyncError as err:
                log.error("weight sync failed: %s", err)
            self.weight_version = version
            versions = self.engine_versions()
            lagging = [e.url for e in live if versions.get(e.url) != version]
            for e in live:
                e.version = versions.get(e.url)
                if e.url in lagging:
                    if e.url in routed and self.router is not None:
                        self.router_remove(e.url)
                    e.state = "needs_weights"
                else:
                    if e.url not in routed and self.router is not None:
                        self.router_add(e.url)
                    e.state = "serving"
        return lagging

    def router_workers(self) -> dict[str, str]:
        """url -> router worker id, for the workers the router currently knows."""
        return router_workers(self.router_url)

    def wait_router_workers(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.router_workers()) >= count:
                return
            time.sleep(0.2)
        raise FleetError(f"router registered {len(self.router_workers())} of {count} workers in {timeout_s:g} s")

    def router_remove(self, url: str) -> bool:
        """Stop routing to an engine (the router keeps no record of it afterwards)."""
        return router_remove(self.router_url, url)

    def router_add(self, url: str, timeout_s: float = 60.0) -> None:
        router_add(self.router_url, url, timeout_s)


# -------------------------------------------------------------------------------------------------
# sglang-router membership and engine probes (the Fleet's, and `fleet rejoin` / `fleet watch` for other launchers)
# -------------------------------------------------------------------------------------------------
def router_workers(router_url: str) -> dict[str, str]:
    """url -> router worker id, for the workers sglang-router currently knows (GET /workers)."""
    status, body = get_json(router_url + "/workers", 10.0)
    if status != 200 or not isinstance(body, dict):
        raise FleetError(f"router GET /workers: HTTP {status}: {body}")
    return {w["url"]: w["id"] for w in body.get("workers", [])}


def router_remove(router_url: str, url: str) -> bool:
    """DELETE /workers/{id}: the router stops routing to ``url`` and forgets it (False: it was not listed). Its own
    health checks would otherwise admit a restarted engine again before it holds the current weights."""
    import urllib.request

    worker_id = router_workers(router_url).get(url)
    if worker_id is None:
        return False
    req = urllib.request.Request(f"{router_url}/workers/{worker_id}", method="DELETE")
    with urllib.request.urlopen(req, timeout=10) as resp:
        ok = resp.status < 300
    deadline = time.monotonic() + 30
    while url in router_workers(router_url) and time.monotonic() < deadline:
        time.sleep(0.1)
    return ok


def router_add(router_url: str, url: str, timeout_s: float = 60.0) -> None:
    """POST /workers {url}, and wait until the router lists it (a no-op when it already does)."""
    if url in router_workers(router_url):
        return
    status, body = post_json(router_url + "/workers", {"url": url}, 10.0)
    if status >= 300 and url not in router_workers(router_url):
        raise FleetError(f"router POST /workers {url}: HTTP {status}: {body}")
    deadline = time.monotonic() + timeout_s
    while url not in router_workers(router_url):
        if time.monotonic() > deadline:
            raise FleetError(f"router did not register {url} in {timeout_s:g} s")
        time.sleep(0.1)


def engine_version(url: str, timeout_s: float = 10.0) -> str | None:
    """The weight_version an engine reports in /model_info (answered while paused; None: no answer or none)."""
    try:
        status, body = get_json(url + "/model_info", timeout_s)
    except OSError:
        return None
    return body.get("weight_version") if status == 200 and isinstance(body, dict) else None


def _probe(url: str, timeout_s: float, peers: list[str] = ()) -> tuple[bool, str | None, str | None]:
    """(GET /health answered 200 within timeout_s, the weight_version it reports, the newest one ``peers`` report)."""
    try:
        healthy = get_json(url + "/health", timeout_s)[0] == 200
    except OSError:
        healthy = False
    return healthy, engine_version(url, timeout_s) if healthy else None, newest_version(peers, timeout_s)


def newest_version(urls: list[str], timeout_s: float = 10.0) -> str | None:
    """The newest weight_version the engines at ``urls`` report (None: none answers)."""
    newest = None
    for url in urls:
        seen = engine_version(url, timeout_s)
        if seen is not None and caught_up(seen, newest):
            newest = seen
    return newest


def _version_rank(version: str | None) -> int:
    try:
        return int(version)
    except (TypeError, ValueError):
        return -1  # SGLang's initial "default", or none reported


def caught_up(version: str | None, current: str | None) -> bool:
    """Whether an engine reporting ``version`` holds the weights of ``current`` (the newest version in service; None:
    not known) or newer. Integer versions (the trainer's policy versions) are ordered; a restarted engine's initial
    "default" equals only "default"."""
    if current is None:
        return True
    rank, newest = _version_rank(version), _version_rank(current)
    return rank > newest or (rank == newest and (newest >= 0 or version == current))


def rejoin(router_url: str, url: str, peers: list[str], timeout_s: float, poll_s: float = 1.0) -> str | None:
    """An engine started again behind ``router_url``: out of the router at once, back in once it answers /health and
    holds the newest weight version its ``peers`` report (the trainer's next push brings it there). Returns that
    version. FleetError after timeout_s."""
    deadline = time.monotonic() + timeout_s
    removed, why = False, "not tried"
    while True:
        try:
            if not removed:
                router_remove(router_url, url)
                removed = True
            healthy, version, newest = _probe(url, 10.0, [p for p in peers if p != url])
            if healthy and caught_up(version, newest):
                router_add(router_url, url)
                return version
            why = f"weight version {version}, the others hold {newest}" if healthy else "/health does not answer"
        except (OSError, FleetError) as err:  # the router is (re)starting
            why = str(err)
        if time.monotonic() > deadline:
            raise FleetError(f"{url} not back in the router after {timeout_s:g} s ({why})")
        time.sleep(poll_s)


def watch(url: str, pid: int, check: EngineWatch) -> str | None:
    """Kill ``pid`` (SIGKILL) once ``url`` has failed ``check.failures`` health checks in a row, counting from its first
    good answer (an engine loading its weights is not judged). Returns why it was killed; None when the process ended."""
    answered, failures = False, 0
    while _pid_alive(pid):
        healthy = _probe(url, check.timeout_s)[0]
        if healthy and not answered:
            print(f"fleet watch: {url} answers; it is killed after {check.failures} failed health checks in a row",
                  flush=True)
        answered = answered or healthy
        failures = 0 if healthy or not answered else failures + 1
        if failures >= check.failures:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                return None
            return f"{url} stopped answering ({failures} health checks in a row failed): killed pid {pid}"
        time.sleep(check.interval_s)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(proc: subprocess.Popen | None, sig: int) -> None:
    if proc is None:
        return
    try:
        os.killpg(proc.pid, sig)  # start_new_session: the child's pid is its process group id
    except (ProcessLookupError, PermissionError):
        pass


# -------------------------------------------------------------------------------------------------
# CLI
# -------------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def _watch_args(parser: argparse.ArgumentParser) -> None:
    d = EngineWatch()
    parser.add_argument("--health-interval-s", type=float, default=d.interval_s, help="seconds between health checks")
    parser.add_argument("--health-timeout-s", type=float, default=d.timeout_s, help="a check slower than this failed")
    parser.add_argument("--health-failures", type=int, default=d.failures,
                        help="checks in a row that fail before the engine counts as hung (killed and restarted)")


def _engine_watch(args: argparse.Namespace, max_restarts: int = 0) -> EngineWatch:
    return EngineWatch(args.health_interval_s, args.health_timeout_s, args.health_failures, max_restarts)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo fleet", description="start N engines behind sglang-router")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="start the fleet and keep it running until Ctrl-C / SIGTERM")
    up.add_argument("--model", required=True, help="HF model directory")
    up.add_argument("--engines", type=int, default=1)
    up.add_argument("--router-port", type=int, default=30000)
    up.add_argument("--engine-base-port", type=int, default=None, help="engine ports base, base+1, ... (default: free)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--engine-command", default=None,
                    help="command template for one engine with {model} {host} {port} (default: megatron-spo serve)")
    up.add_argument("--threads-per-engine", type=int, default=1)
    up.add_argument("--max-restarts", type=int, default=EngineWatch.max_restarts,
                    help="restarts of an engine that exits or stops answering (and of the router) before it is dropped")
    _watch_args(up)
    up.add_argument("--log-dir", default=None, help="engine and router logs, and fleet-events.jsonl (each restart, "
                    "rejoin and drop with the fleet/* metrics)")
    back = sub.add_parser("rejoin", help="an engine another launcher restarted: out of the router now, back in once "
                          "it answers and holds the weight version of the others")
    back.add_argument("--router", required=True, help="sglang-router URL")
    back.add_argument("--engine", required=True, help="the restarted engine's URL")
    back.add_argument("--peers", default="", help="every engine's URL, comma-separated (the others' weight versions)")
    back.add_argument("--timeout-s", type=float, default=3600.0)
    leave = sub.add_parser("leave", help="take an engine out of the router")
    leave.add_argument("--router", required=True)
    leave.add_argument("--engine", required=True)
    hung = sub.add_parser("watch", help="SIGKILL an engine's process once it stops answering its health checks")
    hung.add_argument("--engine", required=True, help="its URL")
    hung.add_argument("--pid", type=int, required=True)
    _watch_args(hung)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fleet %(levelname)s %(message)s")
    try:
        if args.action == "rejoin":
            peers = [u.strip().rstrip("/") for u in args.peers.split(",") if u.strip()]
            version = rejoin(args.router.rstrip("/"), args.engine.rstrip("/"), peers, args.timeout_s)
            print(f"fleet rejoin: {args.engine} back in the router at weight version {version}", flush=True)
            return 0
        if args.action == "leave":
            router_remove(args.router.rstrip("/"), args.engine.rstrip("/"))
            return 0
        if args.action == "watch":
            why = watch(args.engine.rstrip("/"), args.pid, _engine_watch(args))
            if why:
                print(f"fleet watch: {why}", flush=True)
            return 0
    except (FleetError, OSError) as err:
        print(f"megatron-spo fleet {args.action}: {err}", file=sys.stderr)
        return 1
    return _up(args)


def _up(args: argparse.Namespace) -> int:
    ports = None if args.engine_base_port is None else [args.engine_base_port + i for i in range(args.engines)]
    try:
        fleet = Fleet(args.model, args.engines, router_port=args.router_port, host=args.host, engine_ports=ports,
                      engine_command=args.engine_command, threads_per_engine=args.threads_per_engine,
                      log_dir=args.log_dir, watch=_engine_watch(args, args.max_restarts))
    except FleetError as err:  # its message starts with "fleet: "
        print(f"megatron-spo {err}", file=sys.stderr)
        return 2

    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        fleet.start()
        print(f"fleet up: router {fleet.router_url}, engines {' '.join(fleet.engine_urls)}", flush=True)
        seen = fleet.metrics()
        while True:
            time.sleep(1.0)
            now = fleet.metrics()
            if now != seen and args.log_dir:
                with open(os.path.join(args.log_dir, "fleet-events.jsonl"), "a") as f:
                    f.write(json.dumps({"time": time.time(), **now}) + "\n")
            seen = now
            if fleet.router is not None and fleet.router.state == "dropped":
                raise FleetError(f"the router at {fleet.router_url} exited {fleet.router_restarts + 1} times")
            if not fleet.serving() and all(e.state == "dropped" for e in fleet.engines):
                raise FleetError(f"every engine was dropped after {fleet.watch.max_restarts} restarts (--max-restarts)")
    except _Stop as stop:
        log.info("%s: stopping the fleet", stop)
    except FleetError as err:
        print(f"megatron-spo fleet: {err}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    return 0


if __name__ == "__main__":  # python3 -m megatron_spo.rollout.fleet: no `megatron-spo` needed (slurm/launch_workers.sh)
    sys.exit(main(sys.argv[1:]))
