"""GPU check, item 1: tools/bench_logprobs.py at V=128256 (Llama 3's vocabulary), bf16, N=16384 tokens,
H=4096: peak extra memory of one forward + backward and step time, fused vs naive (and vs Liger's fused
linear cross-entropy when liger-kernel imports; it travels as a wheel). Its printed lines are parsed into
numbers. Passes when every variant ran and the fused op's peak is at least 2x below the naive one's (1.2x at
--size tiny, the CPU debug size: N=256, H=64, V=4096 in fp32, two timed rounds).
"""

from __future__ import annotations

import re
import subprocess
import sys

from gpu_result import REPO, PartResult, part_main

# timed beside the default fused op: other fp32 block budgets (MiB); precision: errors against fp32 math
BLOCKS = ["--time-variants", "fused,naive,liger,liger_per_token,gemm,fused_b32,fused_b128,fused_b512",
          "--precision-variants", "fused,naive,liger_per_token"]
FULL = ["--device", "cuda", "--dtype", "bfloat16", "--n", "16384", "--h", "4096", "--v", "128256", "--repeats", "3",
        *BLOCKS]
TINY = ["--n", "256", "--h", "64", "--v", "4096", "--repeats", "2", "--threads", "1", *BLOCKS, "--precision-n", "64"]
NUMBER = r"([-+0-9.eE]+)"


def parse(text: str) -> dict:
    """Numbers of bench_logprobs' report lines (see its main): peaks, medians, ratios, TFLOP/s, GB/s."""
    out = {"peak_gib": {}, "median_s": {}, "time_ratio_medians": {}, "memory_ratio": {}, "bandwidth_gb_s": {},
           "precision": {}, "failed": [], "skipped": []}
    for line in text.splitlines():
        s = line.strip()
        if m := re.match(rf"memory\s+(\S+)\s+peak extra\s+{NUMBER} GiB", s):
            out["peak_gib"][m[1]] = float(m[2])
        elif m := re.match(rf"memory\s+(\S+) / (\S+):\s+{NUMBER}x lower", s):
            out["memory_ratio"][f"{m[1]} / {m[2]}"] = float(m[3])
        elif m := re.match(rf"time\s+(\S+)\s+median\s+{NUMBER} s", s):
            out["median_s"][m[1]] = float(m[2])
        elif m := re.match(rf"time\s+(\S+) / (\S+):\s+{NUMBER}x \(medians\)", s):
            out["time_ratio_medians"][f"{m[1]} / {m[2]}"] = float(m[3])
        elif m := re.match(rf"gemm\s+one N x H x V GEMM:\s+{NUMBER} TFLOP/s", s):
            out["gemm_tflop_s"] = float(m[1])
        elif m := re.match(rf"bandwidth\s+(\S+)\s+{NUMBER} GB/s", s):
            out["bandwidth_gb_s"][m[1]] = float(m[2])
        elif m := re.match(rf"precision\s+(\S+)\s+logp max abs {NUMBER}\s+grad_hidden rel {NUMBER}\s+"
                           rf"grad_weight rel {NUMBER}", s):
            out["precision"][m[1]] = {"logp_max_abs": float(m[2]), "grad_hidden_rel": float(m[3]),
                                      "grad_weight_rel": float(m[4])}
        elif m := re.match(r"(\S+): FAILED: (.*)", s):
            out["failed"].append(f"{m[1]}: {m[2]}")
        elif m := re.match(r"(\S+): skipped: (.*)", s):
            out["skipped"].append(f"{m[1]}: {m[2]}")
    return out


def body(result: PartResult, args) -> None:
    bench_args = FULL if args.size == "full" else TINY
    if args.size == "full" and args.device != "cuda":
        raise ValueError("gpu_part_bench: --size full is the GPU shape; use --size tiny on CPU")
    cmd = [sys.executable, "tools/bench_logprobs.py", *bench_args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    numbers = parse(proc.stdout)
    result.number("command", " ".join(cmd[1:]))
    for key, value in numbers.items():
        if value not in ({}, []):
            result.number(key, value)
    result.require("bench exit status 0", proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:] if proc.returncode else "")
    result.require("no variant failed", not numbers["failed"], "; ".join(numbers["failed"])[:1500])
    if "naive / fused" in numbers["memory_ratio"]:
        result.check("peak memory naive / fused", numbers["memory_ratio"]["naive / fused"],
                     at_least=2.0 if args.size == "full" else 1.2)  # tiny: fixed costs weigh more
    else:
        result.require("peak memory of fused and naive measured", False, proc.stdout[-1500:])


if __name__ == "__main__":
    raise SystemExit(part_main(body))
