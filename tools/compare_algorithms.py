"""SPO vs PPO vs AGRO vs GRPO on the quickstart task: pass@1 / pass@10 before and after, and wall time.

    python tools/compare_algorithms.py [key.path=value ...]     # overrides apply to every run

The SPO paper's Figure 1 in miniature: SPO pushes weights every 10 steps, PPO every step (its
importance weights need near-on-policy data), which is where SPO's wall-clock advantage comes from.
"""

import sys

from megatron_spo.config import apply_overrides, build_config
from megatron_spo.training.quickstart import QuickstartConfig, run


def main(argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    results = {}
    from megatron_spo.training.algos import names

    for algo in names():  # every registered algorithm
        cfg = build_config(QuickstartConfig, apply_overrides({}, [*argv, f"algo={algo}"]), "compare_algorithms")
        results[algo] = run(cfg)
    table = Table(title="quickstart task, held-out problems: reference -> trained (95% CI of the difference)")
    for col in ("algo", "pass@1", "pass@10", "train wall s", "weight pushes"):
        table.add_column(col)
    def cell(r: dict, k: str) -> str:
        lo, hi = r[k]["ci95"]
        return f"{r[k]['before']:.3f} -> {r[k]['after']:.3f} [{lo:+.3f}, {hi:+.3f}]"

    for algo, r in results.items():
        table.add_row(algo.upper(), cell(r, "pass@1"), cell(r, "pass@10"), f"{r['wall_s']['train']:.0f}",
                      str(r.get("weight_pushes", "")))
    Console().print(table)
    spo, ppo = results["spo"]["wall_s"]["train"], results["ppo"]["wall_s"]["train"]
    print(f"SPO trains in {spo / ppo:.2f}x the wall time of PPO ({100 * (ppo - spo) / ppo:.0f}% faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
