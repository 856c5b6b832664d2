"""`megatron-spo verify`: train tabular policies with every loss and compare to the exact optimum.

For each task (a 10-armed bandit; an autoregressive table over vocab 3 x length 3 with padded batches;
the same with an EOS token, so responses have different lengths) and each method (every supported SPO
objective x loss on a fixed sample of pi_0, AGRO off- and on-policy, PPO on-policy with the KL-regularised
token reward, GAE and a tabular value model, and the KL-regularised policy gradient on the same pi_0
sample), report KL(pi || pi*) at the start and the end. Pass: KL falls >= 100x and below 1e-3;
the KL-regularised policy gradient must instead stay far from pi* (KL >= 0.1; AGRO paper, Figure 1).
Also checks Theorems 2.1-2.3 of the SPO paper and the straight-through clip. Writes kl_curves.png and
results.json to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from megatron_spo.algorithms import tabular
from megatron_spo.algorithms.spo import cross_entropy_log_space, straight_through_clamp_max

CONVERGED_KL = 1e-3
MIN_REDUCTION = 100.0
FAR_KL = 0.1

# builders of the checks' problems; beta defaults to each check's own (tests also train them at the paper's)
TASKS = {
    "bandit": lambda beta=0.25: tabular.bandit(10, beta=beta, seed=0),
    "ar": lambda beta=0.5: tabular.autoregressive(3, 3, beta=beta, seed=3),
    "ar-eos": lambda beta=0.5: tabular.autoregressive(3, 3, beta=beta, eos=2, seed=1),
}


def run_passes(result: tabular.RunResult) -> bool:
    if result.method.family == "kl_pg":
        return result.kl_end >= FAR_KL
    return result.kl_end < CONVERGED_KL and result.reduction >= MIN_REDUCTION


def expectation(result: tabular.RunResult) -> str:
    if result.method.family == "kl_pg":
        return f"stays >= {FAR_KL:g}"
    return f"< {CONVERGED_KL:g}, >= {MIN_REDUCTION:g}x"


def theorem_checks(seed: int = 0) -> list[tuple[str, float, float]]:
    """(name, max abs error, tolerance) for the SPO paper's consistency theorems and the clip."""
    gen = torch.Generator().manual_seed(seed)
    checks = []
    for key in ("ar", "ar-eos"):
        task = TASKS[key]()
        theta = 2.0 * torch.randn(task.ref_logits.shape, generator=gen, dtype=torch.float64)
        q0 = float(-torch.rand((), generator=gen, dtype=torch.float64))
        checks.append(
            (f"Thm 2.2 Bellman, random theta ({key})", tabular.bellman_residual(task, theta, q0), 1e-12)
        )
        checks.append(
            (f"Thm 2.3 path, random theta ({key})", tabular.path_consistency_residual(task, theta, q0), 1e-12)
        )
        checks.append((f"Thm 2.1 Q^theta = Q* at pi* ({key})", tabular.optimum_q_residual(task), 1e-12))
    # Straight-through clip: forward is min(y, -eps), backward passes the upstream gradient unchanged.
    y = torch.linspace(-2.0, 1.0, 31, dtype=torch.float64, requires_grad=True)
    upstream = torch.linspace(0.5, 1.5, 31, dtype=torch.float64)
    (straight_through_clamp_max(y, -1e-6) * upstream).sum().backward()
    checks.append(("straight-through clip: grad == upstream", float((y.grad - upstream).abs().max()), 0.0))
    # ... and the cross-entropy's gradient above the clip is the analytic one evaluated at -eps.
    eps, x_log = 1e-3, -0.7
    pred = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    cross_entropy_log_space(pred, torch.tensor([x_log], dtype=torch.float64), eps).sum().backward()
    x, clipped = math.exp(x_log), -eps
    analytic = (1 - x) * math.exp(clipped) / -math.expm1(clipped)
    checks.append(("cross-entropy grad above clip (analytic)", float((pred.grad[0] - analytic).abs()), 1e-9))
    return checks


def run_all(
    task_keys: list[str], method_filters: list[str] | None = None, seed: int = 0
) -> list[tabular.RunResult]:
    """Train every method (or those whose label contains one of method_filters) on every task."""
    results = []
    for key in task_keys:
        task = TASKS[key]()
        for method in tabular.all_methods():
            if method_filters and not any(f in method.label for f in method_filters):
                continue
            results.append(tabular.train(task, method, seed=seed))
    return results


def print_report(results, checks, seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="KL(pi || pi*) on tabular problems (float64, sampled pi_0 data unless noted)")
    for col in ("task", "method", "data", "KL start", "KL end", "reduction", "expected", "ok"):
        table.add_column(col, justify="right" if col.startswith(("KL", "red")) else "left")
    for r in results:
        ok = run_passes(r)
        table.add_row(
            r.task, r.method.label, r.data, f"{r.kl_start:.3e}", f"{r.kl_end:.3e}", f"{r.reduction:.1e}x",
            expectation(r), "[green]yes[/green]" if ok else "[red]NO[/red]",
        )  # fmt: skip
    theorem_table = Table(title="Consistency checks (max abs error)")
    for col in ("check", "max error", "tolerance", "ok"):
        theorem_table.add_column(col)
    for name, err, tol in checks:
        theorem_table.add_row(
            name, f"{err:.2e}", f"{tol:.0e}", "[green]yes[/green]" if err <= tol else "[red]NO[/red]"
        )
    console = Console(width=140)
    console.print(table)
    console.print(theorem_table)
    console.print(f"{len(results)} runs in {seconds:.1f} s")


def save_plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r.task for r in results))
    labels = list(dict.fromkeys(r.method.label for r in results))
    fixed = {
        "agro off-policy": "black",
        "agro on-policy": "dimgrey",
        "ppo (kl reward, gae)": "tab:olive",
        "kl-regularised pg": "red",
    }
    spo_labels = [label for label in labels if label not in fixed]
    colours = {label: plt.get_cmap("tab20")(i % 20) for i, label in enumerate(spo_labels)} | fixed
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 5), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for r in (r for r in results if r.task == task):
            style = {"kl_pg": ":", "agro": "--", "ppo": "-."}.get(r.method.family, "-")
            width = 2.2 if r.method.family != "spo" else 1.3
            curve = [max(k, 1e-16) for k in r.kl_curve]
            ax.plot(r.steps, curve, style, lw=width, color=colours[r.method.label], label=r.method.label)
        ax.axhline(CONVERGED_KL, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(task)
        ax.set_xlabel("step")
        ax.set_ylabel("KL(pi || pi*)")
    handles, names = axes[0][0].get_legend_handles_labels()
    ncol = min(len(names), 3 * len(tasks))
    rows = -(-len(names) // ncol)
    fig.legend(handles, names, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, min(0.4, 0.045 * rows + 0.02), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-spo verify", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="outputs/verify", help="folder for kl_curves.png and results.json")
    parser.add_argument("--tasks", default="bandit,ar,ar-eos", help=f"comma list of {', '.join(TASKS)}")
    parser.add_argument(
        "--methods", default=None, help="comma list: only methods whose label contains one of these texts"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    task_keys = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in task_keys if t not in TASKS]
    if unknown or not task_keys:
        parser.error(
            f"--tasks: unknown task(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(TASKS)}"
        )

    torch.set_num_threads(1)  # tiny tensors: threads only add overhead
    start = time.perf_counter()
    method_filters = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else None
    results = run_all(task_keys, method_filters, args.seed)
    if not results:
        parser.error(f"--methods '{args.methods}' matches no method")
    checks = theorem_checks(args.seed)
    seconds = time.perf_counter() - start
    print_report(results, checks, seconds)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_plot(results, out / "kl_curves.png")
    all_ok = all(run_passes(r) for r in results) and all(err <= tol for _, err, tol in checks)
    summary = {
        "passed": all_ok,
        "runs": [
            {
                "task": r.task, "method": r.method.label, "data": r.data, "kl_start": r.kl_start,
                "kl_end": r.kl_end, "reduction": r.reduction, "passed": run_passes(r),
            }
            for r in results
        ],
        "checks": [{"name": n, "max_error": e, "tolerance": t, "passed": e <= t} for n, e, t in checks],
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    print(f"wrote {out / 'kl_curves.png'} and {out / 'results.json'}")
    print("verify: all checks passed" if all_ok else "verify: SOME CHECKS FAILED")
    return 0 if all_ok else 1
