"""Tests per second: the sandbox pool (one bubblewrap sandbox per program, a fork per test inside it)
against bare ``subprocess.run`` of the same programs (one interpreter per test, no isolation), both with
the same number of concurrent workers. Prints both rates and their ratio, measured in one run.

    python tools/bench_sandbox.py [--programs 24] [--tests 20] [--workers 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_spo.rewards.config import SandboxConfig
from megatron_spo.rewards.sandbox import SandboxPool, outputs_match

PROGRAMS = [
    "n = int(input())\nprint(sum(range(n)))\n",
    "xs = list(map(int, input().split()))\nprint(*sorted(xs))\n",
    "import sys\ndata = sys.stdin.read().split()\nprint(max(map(int, data)))\n",
    "s = input().strip()\nprint(s[::-1])\n",
]


def make_tests(k: int, n_tests: int) -> list[tuple[str, str]]:
    tests = []
    for t in range(n_tests):
        xs = [(7 * t + 13 * i) % 101 for i in range(20)]
        if k == 0:
            tests.append((f"{t + 5}\n", f"{sum(range(t + 5))}\n"))
        elif k == 1:
            tests.append((" ".join(map(str, xs)) + "\n", " ".join(map(str, sorted(xs))) + "\n"))
        elif k == 2:
            tests.append((" ".join(map(str, xs)) + "\n", f"{max(xs)}\n"))
        else:
            tests.append((f"abc{t}xyz\n", f"abc{t}xyz"[::-1] + "\n"))
    return tests


def bare(program: str, tests, python: str) -> list[bool]:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(program)
    try:
        results = []
        for stdin, want in tests:
            run = subprocess.run([python, "-I", f.name], input=stdin.encode(), capture_output=True, timeout=10)
            results.append(run.returncode == 0 and outputs_match(run.stdout, want))
        return results
    finally:
        os.unlink(f.name)


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench_sandbox")
    parser.add_argument("--programs", type=int, default=24)
    parser.add_argument("--tests", type=int, default=20)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    jobs = [(PROGRAMS[i % len(PROGRAMS)], make_tests(i % len(PROGRAMS), args.tests)) for i in range(args.programs)]
    total = args.programs * args.tests

    with SandboxPool(SandboxConfig(slots=args.workers)) as pool:
        pool.submit(*jobs[0]).result()  # warm-up (first start probes and builds filters)
        start = time.perf_counter()
        reports = [f.result() for f in [pool.submit(p, t) for p, t in jobs]]
        pool_s = time.perf_counter() - start
        python = pool.python
    pool_ok = sum(r.statuses.count("ok") for r in reports)

    start = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as ex:
        bare_results = list(ex.map(lambda job: bare(*job, python), jobs))
    bare_s = time.perf_counter() - start
    bare_ok = sum(sum(r) for r in bare_results)

    print(f"{args.programs} programs x {args.tests} tests, {args.workers} workers, interpreter {python}")
    print(f"sandbox pool : {total / pool_s:8.1f} tests/s  ({pool_ok}/{total} ok)")
    print(f"bare run     : {total / bare_s:8.1f} tests/s  ({bare_ok}/{total} ok)")
    print(f"ratio pool / bare: {bare_s / pool_s:.2f}x")
    if pool_ok != total or bare_ok != total:
        sys.exit("bench_sandbox: some tests did not pass: the comparison is not valid")


if __name__ == "__main__":
    main()
