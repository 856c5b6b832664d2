"""The trainer's online side (rank 0): prompts of the task, the rollout manager on a background event
loop as the 'online' data source, and the weight pushes to the fleet.

    source = OnlineSource.from_config(cfg)      # starts generating at once (asynchronously)
    batch = source.take(64)                     # trajectories, blocking until enough are ready
    source.push_weights(version, hf_tensors)    # WeightBroadcaster -> engines, then new requests use it
    source.push_adapter(version, peft_tensors)  # LoRA adapter pushes (push_mode() == "adapter"): AdapterPusher
    source.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import threading
import time
from typing import Any

from megatron_spo.config import ConfigError
from megatron_spo.rollout.client import wait_healthy
from megatron_spo.run_layout import Stopped, children_ignore_preemption_signals, raise_if_stopped
from megatron_spo.training.config import TrainConfig

log = logging.getLogger("megatron_spo.online")


POLL_S = 0.5  # how often a wait looks for a preemption signal and for a fleet that never answered


class FleetUnavailable(RuntimeError):
    """No rollout engine answered within rollout.engine_wait_s: the message is the one-line reason."""


def weight_sync_address() -> str:
    """The address engines reach this process at for the weight-broadcast rendezvous: SPO_WEIGHT_SYNC_ADDR,
    else MASTER_ADDR (rank 0 runs on the first trainer node, the one MASTER_ADDR names), else 127.0.0.1."""
    return os.environ.get("SPO_WEIGHT_SYNC_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1"


def _probe(url: str) -> str:
    """What an endpoint answers right now, for the error naming it (/model_info: SGLang answers it even
    while generation is paused)."""
    from megatron_spo.rollout.client import get_json

    try:
        return f"/model_info: HTTP {get_json(url.rstrip('/') + '/model_info', 2.0)[0]}"
    except OSError as err:
        return str(getattr(err, "reason", None) or err)


async def _stats(manager) -> dict[str, float]:
    return manager.stats()  # read on the loop thread: the manager's state is not thread-safe


def online_q0_table(cfg: TrainConfig, prompts: list) -> dict[str, float] | None:
    """prompt_id -> Q0 of every training prompt from task.q0_path (None: no file, or beta 0, and the algorithm
    reads no Q0).
    An algorithm that reads Q0 (SPO) is refused without the file or with a prompt missing from it, in one
    line: Q0 = 0 is the largest value rewards in {0, -1} allow, not a neutral default."""
    from megatron_spo.data.q0 import ESTIMATE_HINT, q0_table
    from megatron_spo.training.algos import algorithm_needs_q0

    if not algorithm_needs_q0(cfg):  # at beta 0 (GRPO's default) there is no soft value to read
        return q0_table(cfg.task.q0_path, cfg.beta, cfg.task.q0_prior) if cfg.beta > 0 else None
    table = q0_table(cfg.task.q0_path, cfg.beta, cfg.task.q0_prior)
    if table is None:
        raise ConfigError(f"task.q0_path: algo {cfg.algo} needs Q0 for every online prompt and none is set; "
                          f"{ESTIMATE_HINT}")
    missing = [p.prompt_id for p in prompts if p.prompt_id not in table]
    if missing:
        raise ConfigError(f"task.q0_path: {len(missing)} of {len(prompts)} training prompts have no Q0 in "
                          f"{cfg.task.q0_path} (first: '{missing[0]}'); estimate Q0 on this task (megatron-spo "
                          "estimate-q0 with the same config)")
    return table


def q0_from_own_groups(trajectories: list, beta: float) -> None:
    """Set each online trajectory's q0 to beta log mean exp(r / beta) over the rewards of its prompt group in
    this batch: after a reference refresh (reference_refresh_interval) the Q0 table is of the first reference.
    It estimates the soft value under the sampler, not the refreshed reference; the centred squared loss, the
    only SPO loss a refresh allows, does not depend on Q0, so this only keeps the residual diagnostics honest."""
    import torch

    from megatron_spo.algorithms.spo import q0_from_rewards

    groups: dict[Any, list] = {}
    for t in trajectories:
        if t.source == "online":
            groups.setdefault(t.prompt_id, []).append(t)
    for members in groups.values():
        q0 = float(q0_from_rewards(torch.tensor([t.reward for t in members], dtype=torch.float64), beta))
        for t in members:
            t.q0 = q0


def replayed_top_k(cfg: TrainConfig) -> int | None:
    """The experts per token the engines are asked to report (routing_replay: engine on a MoE model), else None."""
    if cfg.routing_replay != "engine":
        return None
    if cfg.model is not None:
        model = cfg.model
    else:
        from megatron_spo.models.hf_checkpoint import read_hf_config

        model = read_hf_config(cfg.init.hf)
    return None if model.moe is None else model.moe.router_topk


def engine_dtype(dtype: str, hf_dir: str | None) -> str:
    """The dtype an engine's /server_info ``dtype`` means: SGLang's 'auto' is the checkpoint's config dtype, except
    float32 checkpoints, served in float16 (sglang configs/model_config.py _get_and_verify_dtype)."""
    if dtype != "auto":
        return dtype.removeprefix("torch.")
    if hf_dir is None:
        return "auto"
    from megatron_spo.models.hf_checkpoint import read_hf_config

    config = read_hf_config(hf_dir).params_dtype
    return "float16" if config == "float32" else config


def dtype_line(served: dict[str, str], trainer_dtype: str) -> str | None:
    """One line on the engines' dtype (url -> dtype) against the trainer's; None when no engine reported one."""
    if not served:
        return None
    kinds = sorted(set(served.values()))
    if kinds == [trainer_dtype]:
        return f"dtype: the engines serve {trainer_dtype}, as the trainer trains (model.params_dtype)"
    return (f"dtype: the engines serve {' / '.join(kinds)}, the trainer trains {trainer_dtype} (model.params_dtype): "
            "their log-probs of the same tokens then differ by ~1e-2 per token (logprob_gap/mean_abs), not ~1e-6; "
            f"start the engines with --dtype {trainer_dtype}, or set model.params_dtype={kinds[0]}")


class OnlineSource:
    """RolloutManager running on its own event loop thread; take(k) is thread-safe and blocking."""

    def __init__(self, manager, *, q0: dict[str, float] | None, on_close=None, start: bool = True):
        """q0: prompt_id -> Q0 attached to every trajectory taken (a prompt it lacks is an error); None: the
        algorithm reads no Q0 and trajectories carry none. start: begin sampling now; False: at start(), the first
        take() or after the first push (the trainer checks the engines' weights first: check_engines)."""
        self.manager = manager
        self.q0 = q0
        self._on_close = on_close or []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True)
        self.thread.start()
        self.started = time.monotonic()
        self._manager_started = False
        if start:
            self.start()

    def start(self) -> None:
        """Start the rollout manager (sampling), once."""
        if not self._manager_started:
            self._manager_started = True
            self.started = time.monotonic()
            self._wait(self.manager.start(), "the rollout manager to start")

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> OnlineSource:
        from transformers import AutoTokenizer

        from megatron_spo.data.problems import problems_from_task_config
        from megatron_spo.data.prompts import make_prompts
        from megatron_spo.environments.base import needs_sandbox as env_needs_sandbox
        from megatron_spo.hooks import load_hook
        from megatron_spo.rewards.reward import RewardPool, needs_sandbox
        from megatron_spo.rewards.sandbox import SandboxPool
        from megatron_spo.rollout.manager import RolloutManager

        endpoints = cfg.fleet.resolved()
        # engine URLs when known: the manager then gates each engine on its weight_version, so one that
        # missed an update gets no work until the next push reaches it; else the router alone
        urls = endpoints.engine_urls or [endpoints.router_url]
        if not endpoints.engine_urls and not endpoints.router_url:
            raise ConfigError("fleet: no rollout endpoints (set fleet.router_url or fleet.engine_urls, or "
                              "SPO_ROUTER_URL / SPO_ENGINE_URLS)")
        if cfg.init.hf is None:
            raise ConfigError("init.hf: the online source needs the HF directory for the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(cfg.init.hf)
        custom = load_hook(cfg.task.reward, field="task.reward") if cfg.task.reward else None
        problems = problems_from_task_config(cfg.task)
        prompts = []
        for prompt in make_prompts(problems, tokenizer):
            if len(prompt.tokens) > cfg.task.max_prompt_tokens:
                log.warning("task: prompt %s has %d tokens > task.max_prompt_tokens, skipped",
                            prompt.prompt_id, len(prompt.tokens))
                continue
            prompts.append(prompt)
        if not prompts:
            raise ConfigError("task: no usable prompts")
        sandbox = None
        # a custom reward, or math only, runs no programs; a multi-turn environment may (code_feedback)
        if needs_sandbox(problems, custom) or env_needs_sandbox(cfg.rollout.env):
            with children_ignore_preemption_signals():
                sandbox = SandboxPool(cfg.sandbox)
        rewards = RewardPool(sandbox, custom=custom)

        async def reward_fn(problem, text: str) -> float:
            return (await rewards.score(problem, text)).reward

        manager = RolloutManager(cfg.rollout, prompts, reward_fn, endpoints=urls,
                                 routed_experts_top_k=replayed_top_k(cfg), tokenizer=tokenizer, sandbox=sandbox)
        broadcaster = None
        if endpoints.engine_urls:
            from megatron_spo.rollout.weight_sync import WeightBroadcaster

            r = cfg.rollout
            tp = endpoints.engine_tp_size
            broadcaster = WeightBroadcaster(endpoints.engine_urls, mode=r.weight_sync,
                                            bucket_bytes=int(r.weight_bucket_mb * 2**20), backend=r.weight_sync_backend,
                                            master_address=weight_sync_address(), disk_dir=r.weight_sync_dir,
                                            engine_tp_sizes=None if tp is None else [tp] * len(endpoints.engine_urls),
                                            pause_mode=r.weight_sync_pause)
        q0 = online_q0_table(cfg, prompts)
        # with the engines known, nothing is sampled before the trainer checked their weights (check_engines)
        source = cls(manager, q0=q0, start=broadcaster is None,
                     on_close=[rewards.close] + [c.close for c in (sandbox, broadcaster) if c is not None])
        source.broadcaster = broadcaster
        source.init = cfg.init
        source.lora = cfg.lora
        return source

    init = None
    lora = None
    _manager_started = True  # (an instance made by __init__ says False until start())

    def check_engines(self, trainer_dtype: str) -> tuple[str | None, str | None]:
        """Rank 0, before the first sample: (why the engines may hold other weights than the trainer's, None when they
        hold init.hf's as loaded; one line on their dtype against the trainer's ``trainer_dtype``, None when they
        report none). They may when one reports a weight_version other than its launch one ('default': a push since
        it loaded, e.g. by an earlier run), serves another folder than init.hf, or the trainer starts from
        init.megatron (full-weight training: its weights need not be init.hf's). The trainer then pushes its own
        weights before sampling starts. Waits for the engines as a push does (rollout.engine_wait_s)."""
        from megatron_spo.rollout.client import get_json

        if self.broadcaster is None:
            return None, None
        self._await_fleet(())
        why, served = [], {}
        hf = os.path.realpath(self.init.hf) if self.init is not None and self.init.hf else None
        for url in self.broadcaster.engine_urls:
            base = url.rstrip("/")
            try:
                (status, info), (s_status, server) = get_json(base + "/model_info", 10.0), get_json(
                    base + "/server_info", 10.0)
            except OSError as err:  # it answered a moment ago: judged by the push that follows
                why.append(f"{url} did not answer /model_info ({err})")
                continue
            info = info if status == 200 and isinstance(info, dict) else {}
            version, path = info.get("weight_version"), info.get("model_path")
            if version not in (None, "", "default"):
                why.append(f"{url} holds weight_version {version!r} (weights pushed since it loaded)")
            elif hf and path and os.path.realpath(str(path)) != hf:
                why.append(f"{url} serves {path}, not init.hf {self.init.hf}")
            dtype = server.get("dtype") if s_status == 200 and isinstance(server, dict) else None
            if dtype:
                served[url] = engine_dtype(str(dtype), self.init.hf if self.init is not None else None)
        if not why and self.init is not None and self.init.megatron and self.lora is None:
            why.append(f"the trainer starts from init.megatron {self.init.megatron}, the engines from init.hf")
        reason = why[0] + (f" (and {len(why) - 1} more)" if len(why) > 1 else "") if why else None
        return reason, dtype_line(served, trainer_dtype)

    broadcaster = None
    adapter_pusher = None
    lora_path: str | None = None  # adapter pushes: the adapter holding the current policy
    last_sync_error: str | None = None
    _fleet_seen_healthy = False
    _fleet_answered = False

    def _wait(self, coro, waiting_for: str) -> Any:
        """Run coro on the loop and wait for its result, every POLL_S giving up with Stopped once SIGTERM /
        SIGUSR1 arrived (so the trainer checkpoints and exits in seconds) and with FleetUnavailable once no
        engine has answered for rollout.engine_wait_s."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            while not future.done():
                concurrent.futures.wait([future], timeout=POLL_S)
                if not future.done():
                    raise_if_stopped(waiting_for)
                    self._check_fleet_answers()
        except BaseException:
            future.cancel()
            raise
        return future.result()

    def _check_fleet_answers(self) -> None:
        if self._fleet_answered or self.manager.metrics.generated_tokens > 0:
            self._fleet_answered = True
            return
        wait_s = self.manager.cfg.engine_wait_s
        if time.monotonic() - self.started > wait_s:
            urls = [ep.url for ep in self.manager.endpoints]
            raise FleetUnavailable(f"rollout fleet: no engine answered within {wait_s:g} s (rollout.engine_wait_s): "
                                   + ", ".join(f"{u} ({why})" for u, why in zip(urls, map(_probe, urls))))

    def _call(self, coro, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def take(self, k: int, timeout_s: float | None = None) -> list:
        """k trajectories (whole groups, cut to k), with q0 attached from the Q0 table.

        Waits at most timeout_s (default rollout.wait_timeout_s), then raises RuntimeError with the rollout
        counters, so a fleet that stopped delivering ends the run with a reason instead of a hang."""
        self.start()
        n = self.manager.cfg.samples_per_prompt
        timeout_s = timeout_s or self.manager.cfg.wait_timeout_s
        try:
            groups = self._wait(self.manager.get_groups(math.ceil(k / n), timeout_s), "rollouts")
        except TimeoutError:
            stats = ", ".join(f"{key.split('/')[-1]} {value:g}" for key, value in self.stats().items()
                              if key.split("/")[-1] in ("requests", "failed_requests", "retries", "reward_errors",
                                                        "groups", "dropped_stale", "queue_depth"))
            sync = f"; last weight sync failed: {self.last_sync_error}" if self.last_sync_error else ""
            raise RuntimeError(f"online source: no batch of {k} trajectories within {timeout_s:g} s "
                               f"(rollout.wait_timeout_s); rollout counters: {stats}{sync}") from None
        out = [t for g in groups for t in g][:k]
        if self.q0 is not None:
            for t in out:
                if str(t.prompt_id) not in self.q0:
                    raise RuntimeError(f"online source: prompt '{t.prompt_id}' has no Q0 in the Q0 table "
                                       "(task.q0_path)")
                t.q0 = self.q0[str(t.prompt_id)]
        return out

    _behind_probe: tuple[int, concurrent.futures.Future] | None = None  # (pushes when it started, its answer)
    _pushes = 0

    def engines_needing_weights(self) -> list[str]:
        """Without waiting: the engines the last finished probe found answering without the weights the fleet holds
        (restarted, or a push missed them: WeightBroadcaster.needs_weights), and the next probe started on a thread
        of its own, so that a hung engine's probe timeout never holds a step. A probe a push overtook is dropped."""
        if getattr(self, "broadcaster", None) is None:
            return []
        found, probe = [], self._behind_probe
        if probe is not None and probe[1].done():
            if probe[0] == self._pushes and probe[1].exception() is None:
                found = probe[1].result()
            probe = None
        if probe is None:
            if getattr(self, "_probe_pool", None) is None:
                self._probe_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-probe")
                self._on_close.append(lambda: self._probe_pool.shutdown(wait=False, cancel_futures=True))
            self._behind_probe = (self._pushes, self._probe_pool.submit(self.broadcaster.needs_weights))
        return found

    def push_weights(self, version: int, named_tensors) -> dict[str, float]:
        """Send the new weights to every engine (pause -> session -> buckets -> continue, weight_sync.py), then
        let new requests carry this policy version. Engines that missed the push keep their old version, so
        version gating gives them no work until a later push reaches them; the metrics count them."""
        from megatron_spo.rollout.weight_sync import WeightSyncError

        if self.broadcaster is None:  # nothing to push to (router only); the gather's owner drains it
            self.loop.call_soon_threadsafe(self.manager.set_policy_version, version)
            self.start()
            return {}
        self._await_fleet(named_tensors)
        self._pushes += 1  # a probe of the engines started before this push no longer tells their state
        try:
            metrics = self.broadcaster.push(named_tensors, version=str(version)).metrics()
            self.last_sync_error = None
        except WeightSyncError as err:
            # a stop signal made the push give up on engines that did not answer (weight_sync._failures): stop
            # now rather than let the trainer send it again (rollout.weight_sync_attempts)
            raise_if_stopped("the weight push")
            self._push_failed(str(err))
            metrics = {"weight_sync/failed": 1.0, "weight_sync/engines_updated": 0.0,
                       "weight_sync/engines_failed": float(len(self.broadcaster.engine_urls))}
        self.loop.call_soon_threadsafe(self.manager.set_policy_version, version)
        self.start()
        return metrics

    def push_mode(self, lora, model_cfg, base_dir: str | None, run_dir: str | None = None) -> str:
        """'adapter' or 'merged', for lora.push (auto: adapter when every engine was started with --enable-lora).
        Asks the engines once (rank 0); an engine that cannot take the adapter it must take is an AdapterPushError
        naming the field (lora.rank, lora.targets, init.hf, lora.push, lora.push_dir). Adapters go by path
        (lora.transport=path: written once under lora.push_dir, default <run_dir>/lora_push) or as tensors."""
        from megatron_spo.rollout.adapter_push import AdapterPusher, AdapterPushError, push_config_dict

        if self.broadcaster is None or lora.push == "merged":  # router only: nothing is pushed anyway
            return "merged"
        self._await_fleet(())
        push_dir = None
        if lora.transport == "path":
            push_dir = lora.push_dir or os.path.join(run_dir or ".", "lora_push")
        pusher = AdapterPusher(self.broadcaster.engine_urls, push_config_dict(lora, model_cfg, base_dir),
                               base_dir=base_dir, push_dir=push_dir)
        try:
            pusher.probe()
        except AdapterPushError as err:
            pusher.close()
            if lora.push == "auto" and str(err).startswith("lora.push:"):  # an engine without LoRA: merged pushes
                log.warning("lora.push=auto: merged weight pushes (%s)", err)
                return "merged"
            raise
        self.adapter_pusher = pusher
        self._on_close.append(pusher.close)
        return "adapter"

    def _await_fleet(self, named_tensors) -> None:
        """Before the first push, wait for the engines to answer (a collective's tensors drained on failure): the
        first push may come before a freshly (re)started fleet is up (a resumed run re-sends its weights at once),
        and an engine missing it would stay gated off with nothing left to train on."""
        if self._fleet_seen_healthy:
            return

        def stopped(_url: str) -> None:  # asked at every poll: SIGTERM ends the wait (Stopped)
            raise_if_stopped("the rollout engines to answer")

        try:
            # /model_info: an engine a stopped run's push left paused must still be found (and resynced)
            wait_healthy(self.broadcaster.engine_urls, self.manager.cfg.engine_wait_s, dead=stopped, path="/model_info")
        except (RuntimeError, Stopped) as err:
            for _ in named_tensors:  # a collective gather: the other ranks see it through
                pass
            if isinstance(err, Stopped):
                raise
            raise FleetUnavailable(f"{err} (rollout.engine_wait_s)") from None
        self._fleet_seen_healthy = True

    def _push_failed(self, error: str) -> None:
        """A push that reached no engine: its one-line error logged and kept for the rollout-wait message."""
        log.error("%s", error)
        self.last_sync_error = error

    def push_adapter(self, version: int, tensors: dict) -> dict[str, float]:
        """Load the adapters ({HF PEFT name: full tensor}) on every engine as a new adapter, switch new requests to
        it (their samples are then exactly this version), then unload the older adapters (adapter_push.py)."""
        self._await_fleet(())
        report = self.adapter_pusher.push(tensors, version)
        if not report.engines_updated:
            self._push_failed(f"adapter push reached no engine: {report.failed}")
            return report.metrics()
        self.last_sync_error = None

        async def switch() -> None:
            self.manager.set_policy_version(version, lora_path=report.lora_name)

        self._call(switch(), timeout=60)  # new requests select the new adapter before any old one goes
        self.lora_path = report.lora_name
        self.adapter_pusher.retire()
        self.start()
        return report.metrics()

    def stats(self) -> dict[str, float]:
        return self._call(_stats(self.manager), timeout=10)

    def state_dict(self) -> dict:
        return {"policy_version": self.manager.policy_version}

    def buffered_groups(self) -> list[list]:
        """The finished groups not yet trained (the manager's taken-but-unserved and its queue, in serving order),
        copied, not taken: what a checkpoint keeps so a resumed run trains on them next (training/checkpoint.py)."""
        async def snapshot():
            queued = list(self.manager.buffer._queue) if self.manager.buffer is not None else []
            return [list(g) for g in [*self.manager._taken, *queued]]

        return self._call(snapshot(), timeout=60)

    def restore_groups(self, groups: list[list]) -> None:
        """Serve these groups (a checkpoint's buffered_groups) before any new one."""
        async def restore():
            self.manager._taken[:0] = groups

        self._call(restore(), timeout=60)

    def load_state_dict(self, state: dict) -> None:
        self.loop.call_soon_threadsafe(self.manager.set_policy_version, state["policy_version"])

    def close(self) -> None:
        try:
            if self._manager_started:
                self._call(self.manager.stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
            for fn in self._on_close:
                try:
                    fn()
                except Exception as err:  # closing must not hide the error that got us here
                    log.warning("online source close: %s", err)
