"""One part of the GPU check (tools/gpu_check.py): its checks against limits, its numbers, its status, as JSON.

    def body(result: PartResult, args) -> None:
        result.check("logp max abs diff", diff, at_most=1e-4)   # a failed check fails the part
        result.number("peak GiB", 1.2)                            # reported, not judged
    if __name__ == "__main__":
        part_main(body)          # --device, --size, --result FILE; an exception is the status "error"

Status: "skipped" (skip() called and no check failed), "fail" (a check failed, or none ran), else "pass".
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]  # the package and the tests' helpers


class PartResult:
    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.numbers: dict = {}
        self.notes: list[str] = []
        self.skip_reason: str | None = None

    def check(self, name: str, value: float, *, at_most: float | None = None, at_least: float | None = None) -> bool:
        """Record value against its limit; NaN fails either way."""
        value = float(value)
        ok = not math.isnan(value)
        if at_most is not None:
            ok &= value <= at_most
        if at_least is not None:
            ok &= value >= at_least
        self.checks.append({"name": name, "value": value, "at_most": at_most, "at_least": at_least, "ok": bool(ok)})
        return bool(ok)

    def require(self, name: str, ok: bool, detail: str = "") -> bool:
        """A yes/no check (e.g. bitwise equality); detail says what was seen when it fails."""
        self.checks.append({"name": name, "value": bool(ok), "ok": bool(ok), **({"detail": detail} if detail else {})})
        return bool(ok)

    def number(self, name: str, value) -> None:
        self.numbers[name] = value

    def note(self, text: str) -> None:
        self.notes.append(text)

    def skip(self, reason: str) -> None:
        self.skip_reason = reason

    def status(self) -> str:
        if any(not c["ok"] for c in self.checks):
            return "fail"
        if self.skip_reason is not None:
            return "skipped"
        return "pass" if self.checks else "fail"

    def as_dict(self) -> dict:
        out = {"status": self.status(), "checks": self.checks, "numbers": self.numbers, "notes": self.notes}
        if self.skip_reason is not None:
            out["reason"] = self.skip_reason
        elif not self.checks:
            out["reason"] = "no check ran"
        return out


def part_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--result", required=True, help="JSON file this part writes")
    parser.add_argument("--work", default=None, help="scratch folder (default: next to --result)")
    return parser.parse_args(argv)


def part_main(body: Callable[[PartResult, argparse.Namespace], None], argv: list[str] | None = None) -> int:
    args = part_args(argv)
    args.work = args.work or os.path.join(os.path.dirname(os.path.abspath(args.result)), "work")
    os.makedirs(args.work, exist_ok=True)
    result = PartResult()
    start = time.perf_counter()
    error = None
    try:
        body(result, args)
    except Exception:  # the part's own failure is its result, not the orchestrator's crash
        error = traceback.format_exc()
    out = result.as_dict()
    if error:
        out["status"], out["reason"] = "error", error.strip().splitlines()[-1]
        out["traceback"] = error[-4000:]
    out["body_s"] = round(time.perf_counter() - start, 3)
    with open(args.result, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return 0
