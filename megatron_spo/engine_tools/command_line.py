"""The engine tools' command lines: the arguments they share and what those name (task and its problems,
tokenizer, sampling settings, a training config's sections, the reward pool), and run_cli (one-line errors,
stop signals that leave a resumable output). Sampling, scoring and the resumable run: engine_tools/sampling.py.

Every tool that scores (estimate-q0, pts, sample, eval) scores as `train` does: with a training config, its
task.reward hook (else the task's built-in reward) in a sandbox of its `sandbox:` section; without one, with
--reward HOOK or the built-in. Each names its reward in one line at start (reward_pool_from_args).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from megatron_spo.config import ConfigError, build_config
from megatron_spo.data.problems import held_out_problems, load_problems, problems_from_task_config
from megatron_spo.data.prompts import Prompt, make_prompts
from megatron_spo.engine_tools.config import ToolSamplingConfig


def add_task_args(parser: argparse.ArgumentParser, *, default_split: str) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="a training config (YAML): its task, reward (task.reward), sandbox, tokenizer (init.hf) "
                             "and engines (fleet) unless given here")
    parser.add_argument("--config", dest="config_flag", default=None, metavar="CONFIG", help="the same, as a flag")
    parser.add_argument("--engine-url", "--router-url", dest="engine_url", default=None,
                        help="an engine or the router, e.g. http://127.0.0.1:30000")
    from megatron_spo.data.tasks import TASK_ALIASES, TASK_KINDS, task_kind_name

    parser.add_argument("--task", default=None, type=task_kind_name, choices=list(TASK_KINDS),
                        help=f"the task ({TASK_ALIASES})")
    parser.add_argument("--data", default=None, help="task file(s) (glob); not for --task toy")
    parser.add_argument("--split", default=default_split, help="toy task split: train | heldout | all")
    parser.add_argument("--toy-seed", type=int, default=0, help="seed of the generated toy task")
    parser.add_argument("--limit", type=int, default=None, help="only the first N problems")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the config's init.hf, else "
                        "the folder the engine serves, asked of it or, behind a router, of its first worker)")
    parser.add_argument("--prompt-format", default="auto", choices=["auto", "raw", "template"])
    parser.add_argument("--reward", default=None, metavar="HOOK",
                        help="score with this reward 'package.module:function' (problem, completion_text) -> float "
                             "(default: the config's task.reward, else the task's built-in reward)")
    parser.add_argument("--sandbox-slots", type=int, default=None,
                        help="concurrent sandboxes (default: the config's sandbox.slots, else 0 = CPUs)")
    parser.add_argument("--isolation", default=None, choices=["bubblewrap", "rlimits-only"],
                        help="default: the config's sandbox.isolation, else bubblewrap")
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


def apply_train_config(args: argparse.Namespace, parser: argparse.ArgumentParser, *, held_out: bool = False) -> None:
    """Fill what the command line left open from a training config (CONFIG or --config, a TrainConfig YAML): its
    task (kind, paths, dedup, toy settings) and reward (task.reward), sandbox, tokenizer (init.hf), engines
    (fleet / SPO_ROUTER_URL) and beta; held_out (eval): its held-out problems (eval.paths, else the generated
    task's held-out split) instead of the training ones. Then check that the task and the engine URL are known."""
    if args.config and args.config_flag and args.config != args.config_flag:
        parser.error(f"two training configs: CONFIG {args.config} and --config {args.config_flag}; give one")
    args.config = args.config or args.config_flag
    args.task_config = args.held_out = args.sandbox_config = args.env = None
    args.config_reward = None  # the config's task.reward, when it names one
    if args.config:
        from megatron_spo.config import load_config
        from megatron_spo.engine_tools.config import TrainConfigView

        cfg = load_config(TrainConfigView, args.config)
        args.task_config = cfg.task if args.task is None else None
        args.held_out = cfg.eval if held_out and args.task_config is not None else None
        args.task = args.task or cfg.task.kind
        args.config_reward = cfg.task.reward
        args.sandbox_config = cfg.sandbox
        args.env = cfg.rollout.env
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
    """The problems a command names: --data (read as --task, or the config's task.kind), else the config's
    held-out (eval) or training problems, else --task's; cut to --limit."""
    if getattr(args, "task_config", None) is not None and args.data is None:
        if args.held_out is not None:
            problems = held_out_problems(args.task_config, args.held_out.paths, args.held_out.limit)
        else:
            problems = problems_from_task_config(args.task_config)
    else:
        problems = load_problems(args.task, args.data, split=args.split, toy_seed=args.toy_seed)
    if args.limit is not None:
        problems = problems[: args.limit]
    if not problems:
        raise ValueError(f"--task {args.task}: no problems to process")
    return problems


def prompts_from_args(args: argparse.Namespace, tokenizer: Any = None) -> list[Prompt]:
    problems = problems_from_args(args)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args.tokenizer, args.engine_url)
    return make_prompts(problems, tokenizer, prompt_format=args.prompt_format)


def engine_tokenizer_path(url: str) -> str | None:
    """The tokenizer folder the engine at ``url`` names in /model_info (tokenizer_path, else model_path); for a
    router, whose /model_info names none (sglang-router answers 404), that of the first of its /workers that
    names one. None when none does. OSError when ``url`` cannot be reached."""
    from megatron_spo.rollout.client import get_json

    def named(base: str) -> str | None:
        status, info = get_json(base.rstrip("/") + "/model_info")
        info = info if status == 200 and isinstance(info, dict) else {}
        return info.get("tokenizer_path") or info.get("model_path") or None

    path = named(url)
    if path is None:
        status, body = get_json(url.rstrip("/") + "/workers")
        workers = body.get("workers", []) if status == 200 and isinstance(body, dict) else []
        for worker in workers:
            try:
                path = named(str(worker.get("url", ""))) if isinstance(worker, dict) else None
            except (OSError, ValueError):  # a worker the router lists but cannot be asked: try the next
                continue
            if path is not None:
                break
    return path


def load_tokenizer(path: str | None, engine_url: str) -> Any:
    """A HF tokenizer from ``path``, or (None) from the folder the engine, or the router's first worker, names
    (engine_tokenizer_path)."""
    from transformers import AutoTokenizer

    if path is None:
        try:
            path = engine_tokenizer_path(engine_url)
        except OSError as err:
            raise ValueError(f"cannot reach {engine_url} for its tokenizer ({err}); pass --tokenizer DIR") from None
        if not path or not os.path.isdir(path):
            why = f"names the folder {path!r}, not on this machine" if path else "names no tokenizer folder"
            raise ValueError(f"{engine_url} (/model_info, or its router's /workers) {why}; pass --tokenizer DIR")
    return AutoTokenizer.from_pretrained(path)


# what the built-in reward of each problem kind checks (rewards/reward.py REWARD_KINDS), for the line naming it
BUILTIN_REWARDS = {"code": "the problem's tests run in the sandbox",
                   "math": "the final answer checked against the problem's"}


def reward_hook_from_args(args: argparse.Namespace) -> tuple[Any, str | None]:
    """(the custom reward, None for the task's built-in; the words naming it). --reward wins over the config's
    task.reward; a hook that does not load is a ConfigError naming the flag or the field."""
    from megatron_spo.hooks import load_hook

    mine, config_reward = args.reward, args.config_reward
    if mine:
        differs = f", not the config's task.reward {config_reward}" if config_reward and config_reward != mine else ""
        return load_hook(mine, field="--reward"), f"--reward {mine}{differs}"
    if config_reward:
        named = f"task.reward {config_reward} of {args.config}, as train scores"
        return load_hook(config_reward, field="task.reward"), named
    return None, None


def reward_pool_from_args(args: argparse.Namespace, problems: Sequence[Any], *, prog: str, hidden: bool = False,
                          env: Any = None):
    """The RewardPool train would score these problems with (reward_hook_from_args; a sandbox pool only when a
    built-in code reward or the environment ``env`` (an EnvConfig) needs one, as the config's ``sandbox:`` and the
    flags set it), after one line naming it. Close with close_reward_pool."""
    from megatron_spo.environments.base import needs_sandbox as env_needs_sandbox
    from megatron_spo.rewards.config import SandboxConfig
    from megatron_spo.rewards.reward import RewardPool, needs_sandbox
    from megatron_spo.rewards.sandbox import SandboxPool
    from megatron_spo.run_layout import children_ignore_preemption_signals

    custom, named = reward_hook_from_args(args)
    if custom is None:
        kinds = sorted({getattr(p, "kind", "code") for p in problems})
        named = "the task's built-in reward (" + "; ".join(
            f"{k}: {BUILTIN_REWARDS.get(k, k)}{' and its hidden tests' if k == 'code' and hidden else ''}"
            for k in kinds) + ")"
    print(f"{prog}: scoring with {named}", flush=True)
    sandbox = None
    if needs_sandbox(problems, custom) or env_needs_sandbox(env):
        flags = {k: v for k, v in (("slots", args.sandbox_slots), ("isolation", args.isolation)) if v is not None}
        base = args.sandbox_config.model_dump() if args.sandbox_config is not None else {}
        cfg = build_config(SandboxConfig, {**base, **flags}, "sandbox (--sandbox-slots, --isolation)")
        with children_ignore_preemption_signals():  # a stop signal for the tool must not kill its scorer
            sandbox = SandboxPool(cfg)
    return RewardPool(sandbox, hidden=hidden, custom=custom)


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
