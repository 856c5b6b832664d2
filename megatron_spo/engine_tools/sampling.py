"""Sampling and scoring for the engine tools (estimate-q0, pts, eval), and their resumable run.

They talk to engines only through EngineClient (one engine or a router) and score in a RewardPool. Each appends
one JSON line per finished item to its output file (data/result_log.py ResultLog), skips the items already there
when re-run, and rewrites the file in input order once every item is done: an interrupted-then-resumed run ends
with the same file as an uninterrupted one, without redoing work. Per-item sampling seeds derive from (seed,
item key), so results do not depend on scheduling.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from megatron_spo.data.result_log import ResultLog
from megatron_spo.engine_tools.config import ToolSamplingConfig
from megatron_spo.rollout.client import EngineError
from megatron_spo.rollout.protocol import Completion, SamplingParams

log = logging.getLogger(__name__)
MAX_BACKOFF_S = 60.0


def derive_seed(seed: int | None, *parts: Any) -> int | None:
    """A 31-bit sampling seed from (seed, parts): stable across runs and machines; None stays None."""
    if seed is None:
        return None
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


async def sample(client: Any, tokens: list[int], n: int, sampling: ToolSamplingConfig, *,
                 seed_key: tuple) -> list[Completion]:
    """n completions of one prompt, sent concurrently: requests of at most samples_per_request samples, or,
    with sampling.seed, one request per sample with its own sampling_seed. SGLang gives every sample of one
    request the same seed (under deterministic inference; seeds do nothing otherwise), so n seeded samples
    in one request would be n copies of one: Q0 from them would be degenerate. A request that fails retryably
    (EngineError.retryable: a timeout, a lost connection, a 5xx) is sent again, the same seed included, up to
    sampling.max_retries times: one stalled request under load does not end a long evaluation."""
    if sampling.seed is None:
        chunk = sampling.samples_per_request
        sizes = [min(chunk, n - start) for start in range(0, n, chunk)]
    else:
        sizes = [1] * n

    async def request(i: int, m: int) -> list[Completion]:
        params = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, n=m,
                                sampling_seed=derive_seed(sampling.seed, *seed_key, i))
        backoff = sampling.retry_backoff_s
        for attempt in range(sampling.max_retries + 1):
            try:
                [group] = await client.generate([tokens], params, return_logprob=False)
                return group
            except EngineError as err:
                if not err.retryable or attempt == sampling.max_retries:
                    raise
                log.warning("%s (attempt %d of %d); sent again in %.1f s", err, attempt + 1,
                            sampling.max_retries + 1, backoff)
                await asyncio.sleep(backoff)
                backoff = min(2 * backoff, MAX_BACKOFF_S)
        raise AssertionError("unreachable")

    groups = await gather_or_cancel([request(i, m) for i, m in enumerate(sizes)])
    return [c for group in groups for c in group]


async def score_all(reward_pool: Any, problem: Any, texts: Sequence[str]) -> list:
    """RewardResult per text, each distinct text scored once (samples of one prompt repeat a lot), concurrently
    (the pool bounds the parallelism)."""
    unique = list(dict.fromkeys(texts))
    results = await gather_or_cancel([reward_pool.score(problem, t) for t in unique])
    by_text = dict(zip(unique, results))
    return [by_text[t] for t in texts]


async def gather_or_cancel(aws: Sequence[Awaitable]) -> list:
    """asyncio.gather that cancels the siblings when one fails (then re-raises that failure)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def progress_bar(enabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), disable=not enabled)


async def run_resumable(items: Sequence[Any], key_of: Callable[[Any], str],
                        work: Callable[[Any], Awaitable[dict]], log: ResultLog | None, *, concurrency: int,
                        description: str, progress: bool = False) -> dict[str, dict]:
    """Run ``work(item) -> record`` for every item not yet in ``log``, ``concurrency`` at a time; each record is
    appended as soon as it is done. Returns every record (earlier runs' included) by key."""
    keys = [key_of(it) for it in items]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"{description}: item key '{dup}' appears twice")
    results = {k: log.records[k] for k in keys if log is not None and k in log}
    todo = [(k, it) for k, it in zip(keys, items) if k not in results]
    gate = asyncio.Semaphore(concurrency)
    with progress_bar(progress) as bar:
        task_id = bar.add_task(description, total=len(items), completed=len(items) - len(todo))

        async def one(key: str, item: Any) -> None:
            async with gate:
                record = await work(item)
            if log is not None:
                log.append(record)
            results[key] = record
            bar.advance(task_id)

        await gather_or_cancel([one(k, it) for k, it in todo])
    if log is not None:
        log.finalize(keys)
    return {k: results[k] for k in keys}
