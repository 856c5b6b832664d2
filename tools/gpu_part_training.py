"""GPU check, item 3: a few SPO, GRPO, PPO and guided-GRPO optimizer steps of the real Trainer on the device: a tiny Llama
(tests/trainer_helpers.make_tiny_hf), the deterministic in-process trajectory source of the trainer tests
(no engines), one process, with train.deterministic. Each run is done twice: the final weights and the logged
losses must be bitwise equal. On a GPU the same runs also go on the CPU (a child process that cannot see the GPU, in parallel)
and must stay close: weights and every logged loss (all O(1) or below) within 1e-4 absolute. On a GPU an
SPO run in bf16 (params_dtype) also runs: finite losses, each within 5e-2 relative of fp32's.
GPU_CHECK_EXERCISE_ALL=1 runs the CPU comparison and the bf16 run on the CPU too (to debug them here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from gpu_result import PartResult, part_main

ALGOS = ("spo", "grpo", "ppo", "grpo-guided")  # grpo-guided: GRPO with demonstrations (grpo.guide_path)


def run_config(root: str, hf: str, algo: str, name: str, steps: int, **overrides) -> dict:
    """The trainer tests' settings (tests/trainer_helpers.trainer_config) for one process, deterministic."""
    from trainer_helpers import trainer_config

    # deterministic: without it an H100 rerun of PPO differed by 4e-9 (2026-11-26)
    return trainer_config(root, hf, name, algo, steps=steps, deterministic=True, **overrides)


def train(runs: list[tuple[dict, str]]) -> None:
    """tests/trainer_helpers.train_and_dump in this process (world of one): weights to each out file."""
    from trainer_helpers import train_and_dump

    train_and_dump(runs)


def losses(run_dir: str) -> list[float]:
    return [json.loads(line)["loss"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double().cpu() - b[k].double().cpu()).abs().max().item() for k in a)


def cpu_reference(root: str, hf: str, steps: int) -> subprocess.Popen:
    """The same fp32 runs on the CPU, in a child that cannot see the GPU (runs while the GPU trains)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.Popen([sys.executable, __file__, "--cpu-runs", root, hf, str(steps)], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(f"{root}/cpu-runs.log", "w"))


def body(result: PartResult, args) -> None:
    from trainer_helpers import make_tiny_hf

    root = args.work
    hf = make_tiny_hf(f"{root}/tiny-hf")
    steps = 3 if args.size == "full" else 2
    cuda = args.device == "cuda" or os.environ.get("GPU_CHECK_EXERCISE_ALL") == "1"
    child = cpu_reference(root, hf, steps) if cuda else None
    runs = [(run_config(root, hf, algo, f"{algo}-{tag}", steps), f"{root}/{algo}-{tag}.pt")
            for algo in ALGOS for tag in ("a", "b")]
    train(runs)
    for algo in ALGOS:
        a, b = (torch.load(f"{root}/{algo}-{tag}.pt") for tag in ("a", "b"))
        loss_a, loss_b = losses(f"{root}/{algo}-a"), losses(f"{root}/{algo}-b")
        result.number(f"{algo} losses", loss_a)
        result.require(f"{algo} steps logged", len(loss_a) == steps, f"{len(loss_a)} of {steps}")
        diff = max_abs_diff(a, b)
        result.require(f"{algo} rerun bitwise (weights, losses)", diff == 0.0 and loss_a == loss_b,
                       f"weights max abs diff {diff:.3g}; losses {loss_a} vs {loss_b}")
        moved = max_abs_diff(a, _initial(hf))
        result.check(f"{algo} weights moved (max abs)", moved, at_least=1e-5)
    if child is None:
        result.note("device is the CPU: the comparison with a CPU run is the rerun itself")
        return
    rc = child.wait()
    result.require("CPU reference runs finished", rc == 0, Path(root, "cpu-runs.log").read_text()[-500:] if rc else "")
    if rc == 0:
        for algo in ALGOS:
            gpu, cpu = torch.load(f"{root}/{algo}-a.pt"), torch.load(f"{root}/{algo}-cpu.pt")
            result.check(f"{algo} GPU vs CPU weights max abs diff", max_abs_diff(gpu, cpu), at_most=1e-4)
            diff = max(abs(x - y) for x, y in zip(losses(f"{root}/{algo}-a"), losses(f"{root}/{algo}-cpu")))
            result.check(f"{algo} GPU vs CPU loss max abs diff", diff, at_most=1e-4)
    bf16_run(result, root, hf, steps)


def bf16_run(result: PartResult, root: str, hf: str, steps: int) -> None:
    """SPO with params_dtype bfloat16 (megatron's bf16 optimizer), last: its failure ends no other run."""
    from megatron_spo.models.hf_checkpoint import read_hf_config

    model = read_hf_config(hf).model_copy(update={"params_dtype": "bfloat16"}).model_dump()
    try:
        train([(run_config(root, hf, "spo", "spo-bf16", steps, model=model), f"{root}/spo-bf16.pt")])
        error = ""
    except Exception as err:  # e.g. its final checkpoint: the steps' losses are still in metrics.jsonl
        error = f"{type(err).__name__}: {err}"
    result.require("spo bf16 run completes (steps, final checkpoint, HF export)", not error, error)
    bf16 = losses(f"{root}/spo-bf16") if Path(root, "spo-bf16", "metrics.jsonl").exists() else []
    result.number("spo bf16 losses", bf16)
    result.require("spo bf16 steps logged, losses finite", len(bf16) == steps and all(abs(x) < float("inf") for x in bf16),
                   str(bf16))
    if bf16:  # step 1's loss is at logp = ref_logp (advantages 0) whatever the dtype: the later ones tell
        fp32 = losses(f"{root}/spo-a")
        rel = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(bf16, fp32))
        result.check("spo bf16 losses max rel diff vs fp32", rel, at_most=5e-2)


def _initial(hf: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{hf}/model.safetensors")


def cpu_runs(root: str, hf: str, steps: int) -> None:
    train([(run_config(root, hf, algo, f"{algo}-cpu", steps), f"{root}/{algo}-cpu.pt") for algo in ALGOS])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cpu-runs"]:
        cpu_runs(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        raise SystemExit(0)
    raise SystemExit(part_main(body))
