"""GPU check, the layouts (issue 60): SPO steps at TP 2 + sequence parallelism and at context parallelism 2 on two
GPUs (NCCL, the local spec: our SP norms and CP attention, whose CUDA branch is torch's lower-right causal SDPA),
against the same steps in one process on one GPU: losses, grad norms and final weights within fp32 tolerances.

Needs two GPUs: with one it is skipped and says so. --device cpu runs the same over gloo (to debug it here).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from gpu_result import PartResult, part_main

LAYOUTS = {"tp2sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True}, "cp2": {"context_parallel_size": 2}}


def body(result: PartResult, args) -> None:
    import json

    from trainer_helpers import make_tiny_hf, run_spawned, trainer_config

    if args.device == "cuda":
        count = torch.cuda.device_count()
        result.number("gpus", count)
        if count < 2:
            result.skip(f"{count} GPU visible: TP 2 + SP and CP 2 need two")
            return
    else:
        result.note("gloo on the CPU: the code path only, not an NCCL run")
    root = Path(tempfile.mkdtemp(prefix="gpu-layouts-"))
    hf = make_tiny_hf(str(root / "hf"))
    steps = 2 if args.size == "tiny" else 3
    run_spawned([(trainer_config(root, hf, "single", "spo", steps=steps), str(root / "single.pt"))], 1)
    for name, parallel in LAYOUTS.items():
        cfg = trainer_config(root, hf, name, "spo", steps=steps)
        cfg["parallel"] = dict(cfg["parallel"], **parallel)
        run_spawned([(cfg, str(root / f"{name}.pt"))], 2)

    def metrics(name):
        return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]

    ref, ref_w = metrics("single"), torch.load(root / "single.pt")
    for name in LAYOUTS:
        got, w = metrics(name), torch.load(root / f"{name}.pt")
        result.check(f"{name}: steps", len(got), at_least=steps)
        result.check(f"{name}: loss max rel diff", max(abs(a["loss"] - b["loss"]) / max(abs(a["loss"]), 1e-6)
                                                       for a, b in zip(ref, got)), at_most=1e-4)
        result.check(f"{name}: grad norm max rel diff", max(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"]
                                                            for a, b in zip(ref, got)), at_most=1e-3)
        result.check(f"{name}: final weights max abs diff", max((w[k] - ref_w[k]).abs().max().item() for k in ref_w),
                     at_most=1e-4)


if __name__ == "__main__":
    part_main(body)
