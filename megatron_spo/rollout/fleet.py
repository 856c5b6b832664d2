"""N generation engines behind the real sglang-router, started, health-checked and torn down together.

    megatron-spo fleet up --model HF_DIR --engines 2 --router-port 30000

Engines are the local engine (``megatron-spo serve``) by default, or any command template, e.g. real
SGLang servers on a GPU node: ``--engine-command "python -m sglang.launch_server --model-path {model}
--host {host} --port {port}"``. Every child runs in its own process group and gets SIGTERM if this
process dies (PR_SET_PDEATHSIG), so neither Ctrl-C, SIGTERM nor a crash leaves a process behind.

Also a context manager, for the trainer and tests:

    with Fleet("tiny_dir", num_engines=2) as fleet:
        client = EngineClient(fleet.router_url)
"""

from __future__ import annotations

import argparse
import ctypes
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


@dataclass
class ManagedProcess:
    name: str
    command: list[str]
    url: str
    proc: subprocess.Popen | None = None
    side_ports: tuple[int, ...] = ()  # other ports the fleet probed for it (the router's metrics exporter)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Fleet:
    """Start ``num_engines`` engines (ports base_port.., default: free ports) and sglang-router."""

    def __init__(self, model_dir: str | None = None, num_engines: int = 1, *, router_port: int | None = None,
                 host: str = "127.0.0.1", engine_ports: list[int] | None = None, engine_command: str | None = None,
                 engine_args: list[str] | None = None, router: bool = True, router_args: list[str] | None = None,
                 threads_per_engine: int | None = 1, startup_timeout_s: float = 300.0, log_dir: str | None = None,
                 env: dict | None = None, router_health: RouterHealth | None = None):
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
        self.removed_dead: list[str] = []
        self._router_spec = (router_health or RouterHealth(), router_args or [])
        self._router_port_chosen = router_port is None
        if router:
            self.router = self._router(router_port or free_port())

    def _engine(self, i: int, port: int) -> ManagedProcess:
        template, extra, threads = self._engine_spec
        return ManagedProcess(f"engine{i}", self._engine_command(template, extra, port, threads),
                              f"http://{self.host}:{port}")

    def _router(self, port: int) -> ManagedProcess:
        health, extra = self._router_spec
        cmd = [sys.executable, "-m", "megatron_spo.cli", "router", "--host", self.host, "--port", str(port),
               "--worker-urls", *[e.url for e in self.engines], "--policy", "round_robin",
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

    def _watch(self, interval_s: float = 0.5) -> None:
        """Take an engine whose process exited out of the router at once (the router's own health check
        would later re-admit a restarted engine before it has the current weights)."""
        while not self._stopping.wait(interval_s):
            for i in self.dead_engines():
                engine = self.engines[i]
                if engine.url in self.removed_dead:
                    continue
                log.error("%s at %s exited (code %s): removing it from the router", engine.name, engine.url,
                          engine.proc.returncode)
                try:
                    self.router_remove(engine.url)
                    self.removed_dead.append(engine.url)
                except (OSError, FleetError) as err:
                    log.error("could not remove %s from the router: %s", engine.url, err)

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
        """Start engine ``index`` again on its port and wait for /health. It is NOT added back to the
        router: the caller first brings it to the current weights, then calls router_add."""
        engine = self.engines[index]
        if engine.alive:
            raise FleetError(f"{engine.name} is still running")
        self._spawn(engine)
        self.wait_healthy(engine)
        if engine.url in self.removed_dead:
            self.removed_dead.remove(engine.url)
        return engine.url

    def engine_versions(self) -> dict[str, str | None]:
        """url -> weight_version reported by each live engine (None when it does not answer)."""
        out: dict[str, str | None] = {}
        for engine in self.engines:
            try:
                status, body = get_json(engine.url + "/model_info", 10.0) if engine.alive else (0, None)
                out[engine.url] = body.get("weight_version") if status == 200 and isinstance(body, dict) else None
            except OSError:
                out[engine.url] = None
        return out

    def sync_weights(self, broadcaster, named_tensors, version: str) -> list[str]:
        """Bring every live engine to ``version`` (one push) and route only to engines that have it.

        Engines outside the router (restarted) join the push and are added back once they hold the version;
        engines that missed it leave the router. Returns the urls left lagging."""
        from megatron_spo.rollout.weight_sync import WeightSyncError

        version = str(version)
        live = [e.url for e in self.engines if e.alive]
        routed = set(self.router_workers()) if self.router is not None else set(live)
        try:
            broadcaster.push(named_tensors, version, engines=live)
        except WeightSyncError as err:
            log.error("weight sync failed: %s", err)
        versions = self.engine_versions()
        lagging = [u for u in live if versions.get(u) != version]
        if self.router is not None:
            for url in live:
                if url in lagging and url in routed:
                    self.router_remove(url)
                elif url not in lagging and url not in routed:
                    self.router_add(url)
        return lagging

    def router_workers(self) -> dict[str, str]:
        """url -> router worker id, for the workers the router currently knows."""
        status, body = get_json(self.router_url + "/workers", 10.0)
        if status != 200 or not isinstance(body, dict):
            raise FleetError(f"router GET /workers: HTTP {status}: {body}")
        return {w["url"]: w["id"] for w in body.get("workers", [])}

    def wait_router_workers(self, count: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.router_workers()) >= count:
                return
            time.sleep(0.2)
        raise FleetError(f"router registered {len(self.router_workers())} of {count} workers in {timeout_s:g} s")

    def router_remove(self, url: str) -> bool:
        """Stop routing to an engine (the router keeps no record of it afterwards)."""
        import urllib.request

        worker_id = self.router_workers().get(url)
        if worker_id is None:
            return False
        req = urllib.request.Request(f"{self.router_url}/workers/{worker_id}", method="DELETE")
        with urllib.request.urlopen(req, timeout=10) as resp:
            ok = resp.status < 300
        deadline = time.monotonic() + 30
        while url in self.router_workers() and time.monotonic() < deadline:
            time.sleep(0.1)
        return ok

    def router_add(self, url: str, timeout_s: float = 60.0) -> None:
        status, body = post_json(self.router_url + "/workers", {"url": url}, 10.0)
        if status >= 300:
            raise FleetError(f"router POST /workers {url}: HTTP {status}: {body}")
        deadline = time.monotonic() + timeout_s
        while url not in self.router_workers():
            if time.monotonic() > deadline:
                raise FleetError(f"router did not register {url} in {timeout_s:g} s")
            time.sleep(0.1)


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
    up.add_argument("--restart-dead", action="store_true",
                    help="restart an engine that exits and add it back to the router (weights as at start)")
    up.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s fleet %(levelname)s %(message)s")
    ports = None if args.engine_base_port is None else [args.engine_base_port + i for i in range(args.engines)]
    try:
        fleet = Fleet(args.model, args.engines, router_port=args.router_port, host=args.host, engine_ports=ports,
                      engine_command=args.engine_command, threads_per_engine=args.threads_per_engine,
                      log_dir=args.log_dir)
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
        while True:
            if args.restart_dead:
                for url in list(fleet.removed_dead):  # the watcher already took it out of the router
                    fleet.restart_engine(fleet.engine_urls.index(url))
                    fleet.router_add(url)
                    log.info("engine %s restarted and re-added", url)
            time.sleep(1.0)
    except _Stop as stop:
        log.info("%s: stopping the fleet", stop)
    except FleetError as err:
        print(f"megatron-spo fleet: {err}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    return 0
