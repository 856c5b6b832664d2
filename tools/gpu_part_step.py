"""GPU check, issue 45: tools/bench_step.py, the real Trainer's SPO step against megatron-core's LM step of the
same model (Llama-3.2-1B shape, random bf16 weights) at 8 x 4096 tokens and one 16k-token sequence.

Its report (step_bench.json / .md) lands in $OUT when set (the device tool brings that folder back), else in the
part's work folder. Judged at the full size by the issue's bars: the SPO step's tokens/s at least 0.65x the LM
step's (its reference forward makes the ideal 0.75x), the LM step at least 35% MFU (of --peak-tflops 989, an
H100 / H200 SXM's dense bf16), and every case, the 16k one included, completed (it fits on the GPU).
At --size tiny (the CPU debug size) only completion and megatron's LM loss of random tokens (~log vocab) are checked.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from gpu_result import REPO, PartResult, part_main

SPO_OVER_LM_MIN = 0.65
LM_MFU_MIN = 0.35


def body(result: PartResult, args) -> None:
    out = Path(os.environ.get("OUT") or args.work)
    cmd = [sys.executable, "tools/bench_step.py", "--device", args.device, "--size", args.size, "--out", str(out)]
    if args.size == "tiny":
        cmd += ["--steps", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    result.number("command", " ".join(cmd[1:]))
    report_file = out / "step_bench.json"
    if not report_file.exists():
        result.require("bench wrote step_bench.json", False, (proc.stdout + proc.stderr)[-2000:])
        return
    report = json.loads(report_file.read_text())
    result.number("device", report["device"])
    for case in report["cases"]:
        tag = f"{case['sequences']} x {case['seq']}"
        if not result.require(f"{tag} completed", "error" not in case, case.get("error", "")):
            continue
        for key in ("spo_tokens_per_s", "lm_tokens_per_s", "spo_peak_gib", "lm_peak_gib", "spo_mfu", "spo_split_s"):
            result.number(f"{tag} {key}", case[key])
        if args.size == "full":
            result.check(f"{tag} SPO / LM tokens/s", case["spo_over_lm"], at_least=SPO_OVER_LM_MIN)
            result.check(f"{tag} LM step MFU", case["lm_mfu"], at_least=LM_MFU_MIN)
        else:
            result.number(f"{tag} SPO / LM tokens/s", case["spo_over_lm"])
            result.check(f"{tag} LM loss - log(vocab)", abs(case["lm_loss"] - math.log(1000)), at_most=0.2)
    result.require("bench exit status 0", proc.returncode == 0, (proc.stdout + proc.stderr)[-1500:])


if __name__ == "__main__":
    raise SystemExit(part_main(body))
