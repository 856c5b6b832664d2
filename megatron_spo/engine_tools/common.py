"""What the engine tools (estimate-q0, pts, eval) share.

They talk to engines only through EngineClient (one engine or a router) and score in a RewardPool. Each appends
one JSON line per finished item to its output file (data/result_log.py ResultLog), skips the items already there
when re-run, and rewrites the file in input order once every item is done: an interrupted-then-resumed run ends
with the same file as an uninterrupted one, without redoing work. Per-item sampling seeds derive from (seed,
item key), so results do not depend on scheduling.

Here: sampling and scoring (sample, score_all), the resumable run (run_resumable), the command-line arguments
and what they name (task, tokenizer, sampling, reward pool), and run_cli (one-line errors, stop signals).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from megatron_spo.config import ConfigError
from megatron_spo.data.problems import load_problems, problems_from_task_config
from megatron_spo.data.prompts import Prompt, make_prompts
from megatron_spo.data.result_log import ResultLog
from megatron_spo.engine_tools.config import ToolSamplingConfig
from megatron_spo.rollout.protocol import Completion, SamplingParams


# ---------------------------------------------------------------------------------------------
# Sampling, scoring and the resumable run
# ---------------------------------------------------------------------------------------------
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
    in one request would be n copies of one: Q0 from them would be degenerate."""
    if sampling.seed is None:
        chunk = sampling.samples_per_request
        sizes = [min(chunk, n - start) for start in range(0, n, chunk)]
    else:
        sizes = [1] * n

    async def request(i: int, m: int) -> list[Completion]:
        params = SamplingParams(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, top_k=sampling.top_k, n=m,
                                sampling_seed=derive_seed(sampling.seed, *seed_key, i))
        [group] = await client.generate([tokens], params, return_logprob=False)
        return group

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


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------
def add_task_args(parser: argparse.ArgumentParser, *, default_split: str) -> None:
    parser.add_argument("--engine-url", "--router-url", dest="engine_url", default=None,
                        help="an engine or the router, e.g. http://127.0.0.1:30000")
    from megatron_spo.data.tasks import TASK_KINDS

    parser.add_argument("--task", default=None, choices=list(TASK_KINDS))
    parser.add_argument("--data", default=None, help="task file(s) (glob); not for --task toy")
    parser.add_argument("--split", default=default_split, help="toy task split: train | heldout | all")
    parser.add_argument("--toy-seed", type=int, default=0, help="seed of the generated toy task")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the engine's)")
    parser.add_argument("--prompt-format", default="auto", choices=["auto", "raw", "template"])
    parser.add_argument("--sandbox-slots", type=int, default=0, help="concurrent sandboxes (0 = CPUs)")
    parser.add_argument("--isolation", default="bubblewrap", choices=["bubblewrap", "rlimits-only"])
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per /generate call")
    parser.add_argument("--no-progress", action="store_true")


def add_sampling_args(parser: argparse.ArgumentParser, defaults: ToolSamplingConfig) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=defaults.temperature)
    g.add_argument("--top-p", type=float, default=defaults.top_p)
    g.add_argument("--top-k", type=int, default=defaults.top_k)
    g.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    g.add_argument("--seed", type=int, default=defaults.seed,
                   help="per-sample sampling seeds derive from it (one request per sample; reproducible only on "
                        "engines with deterministic inference). Default: engine randomness, n per request")
    g.add_argument("--samples-per-request", type=int, default=defaults.samples_per_request)
    g.add_argument("--concurrency", type=int, default=defaults.concurrency, help="prompts in flight")


def sampling_from_args(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "samples_per_request": args.samples_per_request, "concurrency": args.concurrency}


def apply_train_config(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Fill what the command line left open from a training config (``args.config``, a TrainConfig YAML): its
    task (kind, paths, dedup, toy settings), tokenizer (init.hf), engines (fleet / SPO_ROUTER_URL) and beta.
    Then check that the task and the engine URL are known."""
    args.task_config = None
    if getattr(args, "config", None):
        from megatron_spo.config import load_config
        from megatron_spo.engine_tools.config import TrainConfigView

        cfg = load_config(TrainConfigView, args.config)
        args.task_config = cfg.task if args.task is None else None
        args.task = args.task or cfg.task.kind
        args.tokenizer = args.tokenizer or cfg.init.hf
        fleet = cfg.fleet.resolved()
        args.engine_url = args.engine_url or fleet.router_url or (fleet.engine_urls or [None])[0]
        if getattr(args, "beta", None) is None:
            args.beta = cfg.beta
    if args.task is None:
        parser.error("--task is required (or give a training config)")
    if args.engine_url is None:
        parser.error("--engine-url is required (or a training config with fleet endpoints / SPO_ROUTER_URL)")


def problems_from_args(args: argparse.Namespace) -> list:
    if getattr(args, "task_config", None) is not None:
        problems = problems_from_task_config(args.task_config)
    else:
        problems = load_problems(args.task, args.data, split=args.split, toy_seed=args.toy_seed)
    if args.limit is not None:
        problems = problems[: args.limit]
    if not problems:
        raise ValueError(f"--task {args.task}: no problems to process")
    return problems


def prompts_from_args(args: argparse.Namespace) -> list[Prompt]:
    problems = problems_from_args(args)
    return make_prompts(problems, load_tokenizer(args.tokenizer, args.engine_url), prompt_format=args.prompt_format)


def load_tokenizer(path: str | None, engine_url: str) -> Any:
    """A HF tokenizer from ``path``, or from the engine's tokenizer_path (/model_info) when None."""
    from transformers import AutoTokenizer

    from megatron_spo.rollout.client import get_json

    if path is None:
        try:
            status, info = get_json(engine_url.rstrip("/") + "/model_info")
        except OSError as err:
            raise ValueError(f"cannot reach {engine_url} for its tokenizer ({err}); pass --tokenizer DIR") from None
        path = (info or {}).get("tokenizer_path") or (info or {}).get("model_path") if status == 200 else None
        if not path or not os.path.isdir(path):
            raise ValueError(f"{engine_url}/model_info names no local tokenizer folder ({path!r}); "
                             "pass --tokenizer DIR")
    return AutoTokenizer.from_pretrained(path)


def reward_pool_from_args(args: argparse.Namespace, problems: Sequence[Any], *, hidden: bool = False):
    """A RewardPool; a sandbox pool is started only when some problem is code. Close with close_reward_pool."""
    from megatron_spo.rewards.config import SandboxConfig
    from megatron_spo.rewards.reward import RewardPool, needs_sandbox
    from megatron_spo.rewards.sandbox import SandboxPool
    from megatron_spo.run_layout import children_ignore_preemption_signals

    code = needs_sandbox(problems)
    sandbox = None
    if code:
        with children_ignore_preemption_signals():  # a stop signal for the tool must not kill its scorer
            sandbox = SandboxPool(SandboxConfig(slots=args.sandbox_slots, isolation=args.isolation))
    return RewardPool(sandbox, hidden=hidden)


def close_reward_pool(pool: Any) -> None:
    if pool is None:
        return
    pool.close()
    if getattr(pool, "sandbox", None) is not None:
        pool.sandbox.close()


STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)  # SLURM's --signal (time limit), scancel / preemption


def run_cli(prog: str, body: Callable[[], Awaitable[int]]) -> int:
    """asyncio.run(body()) with one-line errors for bad input, Ctrl-C and SIGUSR1 / SIGTERM.

    A stop signal cancels the work in flight and the tool exits once its output holds every item finished so far
    (a re-run resumes): exit 0 after SIGUSR1 (SLURM's "save and exit" warning: spo.sbatch then requeues the job,
    as after the trainer's checkpoint), 128 + 15 after SIGTERM, 130 after Ctrl-C.
    """
    from megatron_spo.rollout.client import EngineError

    stopped_by: list[int] = []

    def record(signum: int, _frame: Any) -> None:  # outside the event loop: starting up, shutting down
        stopped_by.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in STOP_SIGNALS}

    async def guarded() -> int:
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def stop(signum: int) -> None:
            stopped_by.append(signum)
            task.cancel()

        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop, sig)
        try:
            if stopped_by:  # it came while the tool was starting
                raise asyncio.CancelledError
            return await body()
        finally:
            for sig in STOP_SIGNALS:
                loop.remove_signal_handler(sig)
                signal.signal(sig, record)

    try:
        return asyncio.run(guarded())
    except asyncio.CancelledError:
        if not stopped_by:
            raise
        name = signal.Signals(stopped_by[0]).name
        print(f"{prog}: stopped by {name}; the output keeps every finished item: re-run the same command to resume",
              flush=True)
        return 0 if stopped_by[0] == signal.SIGUSR1 else 128 + stopped_by[0]
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; re-run the same command to resume", flush=True)
        return 130
    except (ValueError, FileNotFoundError, EngineError) as err:
        if isinstance(err, ConfigError):
            raise
        print(f"{prog}: error: {err}", flush=True)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
