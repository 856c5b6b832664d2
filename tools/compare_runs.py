"""Two quickstart runs compared on the same held-out problems: pass@1 / pass@10 of run B minus run A.

    python tools/compare_runs.py RUN_A_DIR RUN_B_DIR [--json]

RUN_*_DIR is a quickstart output (OUT_DIR/ALGO: eval_after.jsonl per held-out problem). The difference is
paired per problem with a 95% percentile-bootstrap interval over problems (the quickstart's own
paired_bootstrap), so the same problem's difficulty cancels out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_spo.experiments.quickstart import paired_bootstrap  # noqa: E402


def per_problem(run: Path) -> dict[str, dict]:
    path = run / "eval_after.jsonl"
    if not path.is_file():
        raise SystemExit(f"compare_runs: {path} not found (a quickstart output dir OUT_DIR/ALGO?)")
    return {row["prompt_id"]: row for row in map(json.loads, path.read_text().splitlines()) if row}


def compare(a: Path, b: Path, ks=(1, 10)) -> dict:
    ra, rb = per_problem(a), per_problem(b)
    ids = sorted(ra.keys() & rb.keys())
    out = {"problems": len(ids), "a": str(a), "b": str(b)}
    for k in ks:
        deltas = [rb[i][f"pass@{k}"] - ra[i][f"pass@{k}"] for i in ids]
        mean, lo, hi = paired_bootstrap(deltas, seed=k)
        out[f"pass@{k}"] = {"a": sum(ra[i][f"pass@{k}"] for i in ids) / len(ids),
                            "b": sum(rb[i][f"pass@{k}"] for i in ids) / len(ids), "delta": mean, "ci95": [lo, hi]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = compare(args.run_a, args.run_b)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['problems']} held-out problems: B = {args.run_b}, A = {args.run_a}")
    for k in (1, 10):
        r = result[f"pass@{k}"]
        verdict = "B better" if r["ci95"][0] > 0 else "A better" if r["ci95"][1] < 0 else "no difference shown"
        print(f"pass@{k}: A {r['a']:.3f}  B {r['b']:.3f}  B - A {r['delta']:+.3f} "
              f"[{r['ci95'][0]:+.3f}, {r['ci95'][1]:+.3f}]  ({verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
