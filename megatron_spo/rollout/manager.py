"""Asynchronous rollout manager: keeps engines busy and feeds a bounded buffer the trainer drains.

Each worker task loops: pick a prompt, draw a temperature T ~ U(lo, hi), POST /generate with n samples
and logprobs, score every completion with the reward function, and put the group into the buffer. A
full buffer blocks the workers (backpressure: at most max_inflight_requests requests in flight and
buffer_groups groups waiting, nothing unbounded). Engine errors are retried with exponential backoff on
another endpoint; each request keeps one request id across retries (each attempt sends its own SGLang rid:
SGLang refuses an id that is still in flight) and a group is delivered at most once per id. A request
aborted by a weight update's pause (finish_reason abort) is sent again, and is not an engine failure.

A trajectory's policy_version is the oldest weight version among its tokens (SGLang reports which version
produced which tokens in meta_info.weight_versions): a sample that spans a weight update (a request
retracted and resumed) is kept and marked (rollout.mixed_version_policy=tag) or generated again (drop), and
counted. A group more than max_staleness policy versions behind is dropped or tagged.

    manager = RolloutManager(cfg, prompts, reward_fn, endpoints=[fleet.router_url])
    await manager.start()
    groups = await manager.get_groups(8)        # list of groups, each a list of n Trajectory
    manager.set_policy_version(step)            # after pushing new weights to the engines
    await manager.stop()

Endpoints are the router (one URL; the fleet takes lagging engines out of it) or engine URLs (the
manager routes itself, skipping endpoints that fail or report an older weight_version).
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_spo.data.prompts import Prompt
from megatron_spo.data.trajectory import FIELDS as RECORD_FIELDS
from megatron_spo.data.trajectory import Trajectory as TrajectoryRecord
from megatron_spo.rollout.client import EngineClient, EngineError
from megatron_spo.rollout.config import RolloutConfig
from megatron_spo.rollout.protocol import Completion, SamplingParams

log = logging.getLogger("megatron_spo.rollout")

RewardFn = Callable[[Any, str], "float | Awaitable[float]"]
MAX_INTERRUPTIONS = 50  # aborts / mixed-version redos of one request before it counts as failed


@dataclass
class Trajectory(TrajectoryRecord):
    """One completion: the record of DESIGN.md (megatron_spo.data.trajectory) plus sampling metadata."""

    request_id: str = ""
    sample_index: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    finish_reason: str = ""
    stale: bool = False
    mixed_versions: bool = False  # its tokens come from more than one weight version
    weight_versions: list | None = None  # [(version, start, end)] over response_tokens, as the engine reported
    text: str = ""

    def to_record(self) -> dict:
        """The trajectory record (JSONL line / offline-store row): record fields only."""
        return {k: v for k, v in self.to_dict().items() if k in RECORD_FIELDS}


def parse_version(version: str | None) -> int:
    """Engine weight_version -> policy version (SGLang's initial version is 'default' = 0)."""
    if version in (None, "", "default"):
        return 0
    try:
        return int(version)
    except ValueError:
        raise EngineError("weight_version", f"not an integer policy version: {version!r}", retryable=False) from None


@dataclass
class Endpoint:
    url: str
    client: EngineClient
    failures: int = 0  # consecutive
    cooldowns: int = 0
    down_until: float = 0.0
    version: int | None = None  # last weight_version seen (direct mode)
    requests: int = 0
    errors: int = 0


@dataclass
class RolloutMetrics:
    started: float = field(default_factory=time.monotonic)
    requests: int = 0
    retries: int = 0
    failed_requests: int = 0
    groups_delivered: int = 0
    groups_dropped_stale: int = 0
    duplicates_dropped: int = 0
    reward_errors: int = 0
    generated_tokens: int = 0
    aborted_requests: int = 0  # ended by an engine's pause (a weight update), sent again
    retracted_samples: int = 0  # delivered samples that a pause retracted and resumed
    mixed_version_samples: int = 0  # delivered samples whose tokens span a weight update (tagged)
    mixed_version_dropped: int = 0  # requests generated again because a sample spanned an update (drop)
    staleness: collections.Counter = field(default_factory=collections.Counter)


class RolloutManager:
    def __init__(self, cfg: RolloutConfig, prompts: Sequence[Prompt] | Iterable[Prompt], reward_fn: RewardFn, *,
                 endpoints: list[str], source: str = "online", check_versions: bool | None = None):
        if not endpoints:
            raise ValueError("RolloutManager needs at least one endpoint url")
        self.cfg = cfg
        self.reward_fn = reward_fn
        self.source = source
        self.rng = random.Random(cfg.seed)
        self._prompts = self._prompt_stream(prompts)
        self.endpoints = [Endpoint(u.rstrip("/"), EngineClient(u, timeout_s=cfg.request_timeout_s)) for u in endpoints]
        # version gating per endpoint only makes sense when the endpoints are engines, not one router
        self.check_versions = len(endpoints) > 1 if check_versions is None else check_versions
        self.policy_version = 0
        self.buffer: asyncio.Queue[list[Trajectory]] | None = None
        self.metrics = RolloutMetrics()
        self._delivered: set[str] = set()
        self._request_ids = itertools.count()
        self._round_robin = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._taken: list[list[Trajectory]] = []
        self.max_requests: int | None = None

    def _prompt_stream(self, prompts):
        if isinstance(prompts, Sequence):
            if not prompts:
                raise ValueError("RolloutManager: empty prompt list")
            order = list(prompts)

            def cycle():
                while True:
                    self.rng.shuffle(order)
                    yield from order

            return cycle()
        return iter(prompts)

    # --- lifecycle -------------------------------------------------------------------------------
    async def start(self, max_requests: int | None = None) -> None:
        """Start the workers. With max_requests, stop issuing new requests after that many."""
        if self.cfg.samples_per_prompt > 1:
            await self._refuse_deterministic_engines()
        self.buffer = asyncio.Queue(maxsize=self.cfg.buffer_groups)
        self.max_requests = max_requests
        self.metrics = RolloutMetrics()
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.cfg.max_inflight_requests)]

    async def _refuse_deterministic_engines(self) -> None:
        """An SGLang engine with --enable-deterministic-inference gives every sample of a request one seed
        (42 when unseeded): the n samples of a group would be copies, and every group baseline degenerate.
        Engines that do not answer /server_info yet (starting, or a router) are not judged."""
        async def deterministic(ep: Endpoint) -> bool:
            try:
                info = await ep.client.server_info()
            except EngineError:
                return False
            return isinstance(info, dict) and bool(info.get("enable_deterministic_inference"))

        flagged = [ep.url for ep, on in zip(self.endpoints, await asyncio.gather(
            *[deterministic(ep) for ep in self.endpoints])) if on]
        if flagged:
            raise ValueError(f"rollout engines {flagged} run with --enable-deterministic-inference: the "
                             f"{self.cfg.samples_per_prompt} samples of each request would be identical "
                             "(SGLang shares one seed among them); restart them without it")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for ep in self.endpoints:
            await ep.client.close()

    async def join(self) -> None:
        """Wait for the workers to finish (only returns when max_requests was given)."""
        await asyncio.gather(*self._tasks)

    def set_policy_version(self, version: int) -> None:
        """Called by the trainer after every engine has the new weights."""
        self.policy_version = int(version)

    async def get_groups(self, num_groups: int, timeout_s: float | None = None) -> list[list[Trajectory]]:
        """Take num_groups finished groups (blocks until they exist). The staleness bound is applied again
        here: a group may have aged in the buffer while the trainer moved on."""
        taken = self._taken  # groups a timed-out call already took off the queue are served first

        async def take():
            while len(taken) < num_groups:
                group = await self.buffer.get()
                if self._too_stale(group):
                    if self.cfg.stale_policy == "drop":
                        self.metrics.groups_dropped_stale += 1
                        continue
                    for t in group:
                        t.stale = True
                taken.append(group)

        if timeout_s:
            await asyncio.wait_for(take(), timeout_s)  # on timeout, `taken` keeps its groups for the next call
        else:
            await take()
        groups, taken[:] = taken[:num_groups], taken[num_groups:]
        return groups

    def stats(self) -> dict[str, float]:
        m = self.metrics
        elapsed = max(time.monotonic() - m.started, 1e-9)
        out = {
            "rollout/tokens_per_s": m.generated_tokens / elapsed,
            "rollout/queue_depth": float(self.buffer.qsize() + len(self._taken) if self.buffer else 0),
            "rollout/reward_errors": float(m.reward_errors),
            "rollout/requests": float(m.requests), "rollout/retries": float(m.retries),
            "rollout/failed_requests": float(m.failed_requests), "rollout/groups": float(m.groups_delivered),
            "rollout/dropped_stale": float(m.groups_dropped_stale),
            "rollout/duplicates_dropped": float(m.duplicates_dropped),
            "rollout/aborted_requests": float(m.aborted_requests),
            "rollout/retracted_samples": float(m.retracted_samples),
            "rollout/mixed_version_samples": float(m.mixed_version_samples),
            "rollout/mixed_version_dropped": float(m.mixed_version_dropped),
        }
        for lag, count in sorted(m.staleness.items()):
            out[f"rollout/staleness_{lag}"] = float(count)
        return out

    # --- work ------------------------------------------------------------------------------------
    async def _worker(self, index: int) -> None:
        while True:
            if self.max_requests is not None and self.metrics.requests >= self.max_requests:
                return
            prompt = next(self._prompts, None)
            if prompt is None:  # a finite prompt iterator ran out
                return
            self.metrics.requests += 1
            request_id = f"r{next(self._request_ids)}-{prompt.prompt_id}"
            lo, hi = self.cfg.temperature_range
            params = SamplingParams(max_new_tokens=self.cfg.max_new_tokens, temperature=self.rng.uniform(lo, hi),
                                    top_p=self.cfg.top_p, top_k=self.cfg.top_k, n=self.cfg.samples_per_prompt)
            completions = await self._generate_with_retries(prompt, params, request_id)
            if completions is None:
                continue
            try:
                group = await self._score(prompt, params, request_id, completions)
            except Exception:  # a broken reward must not kill the worker: logged, counted, group dropped
                self.metrics.reward_errors += 1
                log.exception("reward of request %s failed: group dropped", request_id)
                continue
            await self._deliver(request_id, group)

    async def _generate_with_retries(self, prompt: Prompt, params: SamplingParams,
                                     request_id: str) -> list[Completion] | None:
        backoff = self.cfg.retry_backoff_s
        attempt = interruptions = 0
        while True:
            ep = await self._pick_endpoint()
            ep.requests += 1
            rid = f"{request_id}.{attempt + interruptions}"
            try:
                [completions] = await ep.client.generate([prompt.tokens], params, return_logprob=True,
                                                         rid=rid, timeout_s=self.cfg.request_timeout_s)
                self._check_completions(ep, completions, params)
            except EngineError as err:
                ep.errors += 1
                if not err.retryable:
                    log.error("request %s rejected (not retried): %s", request_id, err)
                    self.metrics.failed_requests += 1
                    return None
                self._mark_failure(ep)
                if attempt == self.cfg.max_retries:
                    break
                attempt += 1
                self.metrics.retries += 1
                log.warning("request %s attempt %d failed on %s: %s; retrying in %.2f s", request_id, attempt,
                            ep.url, err, backoff)
                await asyncio.sleep(backoff * (0.5 + self.rng.random()))
                backoff = min(backoff * 2, self.cfg.retry_backoff_max_s)
                continue
            ep.failures = 0
            again = None
            if any(c.finish_reason == "abort" for c in completions):
                self.metrics.aborted_requests += 1
                again = "aborted by the engine (a weight update's pause)"
            elif self.cfg.mixed_version_policy == "drop" and any(len(set(c.versions)) > 1 for c in completions):
                self.metrics.mixed_version_dropped += 1
                again = "a sample spans a weight update (rollout.mixed_version_policy=drop)"
            if again is None:
                return completions
            interruptions += 1
            if interruptions > MAX_INTERRUPTIONS:
                log.error("request %s: %s %d times, given up", request_id, again, interruptions)
                self.metrics.failed_requests += 1
                return None
            log.info("request %s %s: sent again", request_id, again)
        log.error("request %s failed after %d attempts", request_id, self.cfg.max_retries + 1)
        self.metrics.failed_requests += 1
        return None

    def _check_completions(self, ep: Endpoint, completions: list[Completion], params: SamplingParams) -> None:
        for c in completions:
            if c.finish_reason == "abort":
                continue  # partial output, sent again by the caller
            if c.logprobs is None or len(c.output_ids) > params.max_new_tokens:
                raise EngineError(ep.url, f"inconsistent completion {c.rid}: {len(c.output_ids)} tokens")
            version = parse_version(c.weight_version)
            if self.check_versions and version < self.policy_version:
                # an engine that missed the last update (e.g. restarted): no work until it reports the current
                # version again; the response is discarded and the request retried elsewhere
                ep.version = version
                raise EngineError(ep.url, f"engine at weight_version {version} < policy {self.policy_version}")

    def _mark_failure(self, ep: Endpoint) -> None:
        ep.failures += 1
        if ep.failures >= self.cfg.endpoint_max_failures:
            cooldown = min(self.cfg.endpoint_cooldown_s * (2 ** ep.cooldowns), 300.0)
            ep.down_until = time.monotonic() + cooldown
            ep.cooldowns += 1
            ep.failures = 0
            log.error("endpoint %s failing: no work for %.1f s", ep.url, cooldown)

    async def _pick_endpoint(self) -> Endpoint:
        """Round robin over endpoints that are not cooling down (and, in direct mode, report the current
        weight_version). When none qualifies, wait for the first cooldown to end."""
        while True:
            now = time.monotonic()
            ready = [ep for ep in self.endpoints if ep.down_until <= now]
            if self.check_versions:
                ready = [ep for ep in ready if await self._has_current_weights(ep)]
            if ready:
                return ready[next(self._round_robin) % len(ready)]
            wake = min((ep.down_until for ep in self.endpoints if ep.down_until > now), default=now + 0.5)
            await asyncio.sleep(max(0.05, min(wake - now, 1.0)))

    async def _has_current_weights(self, ep: Endpoint) -> bool:
        if ep.version is not None and ep.version >= self.policy_version:
            return True
        try:
            ep.version = parse_version(await ep.client.weight_version())
        except EngineError:
            self._mark_failure(ep)
            return False
        if ep.version < self.policy_version:
            ep.down_until = time.monotonic() + 0.5  # re-check soon: it may be catching up
            return False
        return True

    async def _score(self, prompt: Prompt, params: SamplingParams, request_id: str,
                     completions: list[Completion]) -> list[Trajectory]:
        rewards = await asyncio.gather(*[self._reward(prompt.problem, c.text) for c in completions])
        group = []
        for i, (c, reward) in enumerate(zip(completions, rewards)):
            self.metrics.generated_tokens += len(c.output_ids)
            versions = [parse_version(v) for v in c.versions] or [0]
            mixed = len(set(versions)) > 1
            self.metrics.mixed_version_samples += mixed
            self.metrics.retracted_samples += c.num_retractions > 0
            group.append(Trajectory(
                prompt_id=prompt.prompt_id, prompt_tokens=list(prompt.tokens), response_tokens=c.output_ids,
                reward=float(reward), source=self.source, policy_version=min(versions),
                behaviour_logprobs=c.logprobs, request_id=request_id, sample_index=i,
                temperature=params.temperature, top_p=params.top_p, finish_reason=c.finish_reason,
                mixed_versions=mixed, weight_versions=c.weight_versions, text=c.text,
            ))
        return group

    async def _reward(self, problem: Any, text: str) -> float:
        result = self.reward_fn(problem, text)
        if inspect.isawaitable(result):
            result = await result
        return float(result)

    def _too_stale(self, group: list[Trajectory]) -> bool:
        return self.policy_version - min(t.policy_version for t in group) > self.cfg.max_staleness

    async def _deliver(self, request_id: str, group: list[Trajectory]) -> None:
        if request_id in self._delivered:
            self.metrics.duplicates_dropped += 1
            log.error("request %s delivered twice: dropping the duplicate", request_id)
            return
        lag = self.policy_version - min(t.policy_version for t in group)
        self.metrics.staleness[lag] += 1
        if self._too_stale(group):
            if self.cfg.stale_policy == "drop":
                self.metrics.groups_dropped_stale += 1
                self._delivered.add(request_id)
                return
            for t in group:
                t.stale = True
        self._delivered.add(request_id)
        await self.buffer.put(group)  # blocks while the buffer is full: backpressure
        self.metrics.groups_delivered += 1
