"""The engine tools' command lines: the arguments they share and what those name (task and its problems,
tokenizer, sampling settings, a training config's sections, the reward pool), and run_cli (one-line errors,
stop signals that leave a resumable output). Sampling, scoring and the resumable run: engine_tools/sampling.py.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from megatron_spo.config import ConfigError
from megatron_spo.data.problems import load_problems, problems_from_task_config
from megatron_spo.data.prompts import Prompt, make_prompts
from megatron_spo.engine_tools.config import ToolSamplingConfig


def add_task_args(parser: argparse.ArgumentParser, *, default_split: str) -> None:
    parser.add_argument("--engine-url", "--router-url", dest="engine_url", default=None,
                        help="an engine or the router, e.g. http://127.0.0.1:30000")
    from megatron_spo.data.tasks import TASK_ALIASES, TASK_KINDS, task_kind_name

    parser.add_argument("--task", default=None, type=task_kind_name, choices=list(TASK_KINDS),
                        help=f"the task ({TASK_ALIASES})")
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
    g.add_argument("--max-retries", type=int, default=defaults.max_retries,
                   help="retries of a request that timed out, lost its connection or got a 5xx")


def sampling_from_args(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "max_new_tokens": args.max_new_tokens, "seed": args.seed,
            "samples_per_request": args.samples_per_request, "concurrency": args.concurrency,
            "max_retries": args.max_retries}


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
