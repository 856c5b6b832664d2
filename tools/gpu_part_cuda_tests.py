"""GPU check, item 1: the tests that skip without a GPU (`grep -rn cuda tests | grep skip`: the CUDA tests of
tests/test_ops_logprobs.py: Triton compiled for real, bf16 GEMMs with fp32 output, FP8, peak memory), run by
pytest on the device. Passes when pytest exits 0 with at least one test passed; on CPU they all skip.
"""

from __future__ import annotations

import re
import subprocess
import sys

from gpu_result import REPO, PartResult, part_main

TESTS = ["tests/test_ops_logprobs.py", "-k", "cuda"]


def summary_counts(text: str) -> dict[str, int]:
    """{'passed': n, 'failed': n, 'skipped': n, 'error': n, ...} from pytest's last summary line."""
    counts = {}
    lines = [line for line in text.strip().splitlines() if line.strip()]
    for number, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", lines[-1] if lines else ""):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


def body(result: PartResult, args) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *TESTS]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    counts = summary_counts(proc.stdout)
    result.number("pytest", counts)
    result.number("command", " ".join(cmd[1:]))
    failed = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if failed:
        result.number("failed tests", failed[:20])
    if args.device == "cpu" and proc.returncode == 0 and not counts.get("passed"):
        result.skip(f"no GPU: {counts.get('skipped', 0)} CUDA tests skipped")
        return
    result.require("pytest exit status 0", proc.returncode == 0, proc.stdout[-1500:] if proc.returncode else "")
    result.check("CUDA tests passed", counts.get("passed", 0), at_least=1)


if __name__ == "__main__":
    raise SystemExit(part_main(body))
