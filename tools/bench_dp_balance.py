"""How evenly a step's tokens land on the data-parallel ranks: prompt groups dealt round-robin (the old shard) against
dealt by tokens (training/micro_batches.py::shard, longest-processing-time first + a refinement pass).

    python tools/bench_dp_balance.py                          # 128 prompts x 8, DP 8/16/32, seeds 0-4
    python tools/bench_dp_balance.py --prompts 16 --exact     # examples/llama3.1-8b-spo.yaml, all online: 128
                                                              # sequences per step in groups of 8
    python tools/bench_dp_balance.py --prompts 8 --singles 64 # its source mix: 64 online (8 x 8) + 64 offline / MC
                                                              # records of their own prompts
    python tools/bench_dp_balance.py --json

Pure arithmetic, no model: each prompt has a prompt of uniform 64..2048 tokens and --group responses of log-normal
length (mu = ln(2000) ~ 7.60, sigma = 1.0 by default: median 2000, mean ~3300) clipped to 200..32768 tokens; with
--prompt-sigma s each prompt's responses share a log-median ln(2000) + N(0, s) (hard prompts answer long).
A group's tokens = the sum of record_tokens (prompt + response) over its trajectories. Per DP size and seed it
prints max / mean tokens per rank for both deals, and the floor no deal of whole groups can beat:
max(largest group, total / DP) / mean. The step waits for the most-loaded rank, so max / mean is the step's
time over a perfectly balanced one (at equal tokens/s per rank). --exact adds the best deal of whole groups there is
(a branch and bound, for small counts: a few groups a rank), to tell the greedy's shortfall from the floor's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_spo.data.trajectory import record_tokens  # noqa: E402
from megatron_spo.training.micro_batches import deal_by_tokens, shard  # noqa: E402

MU, SIGMA, LOW, HIGH = math.log(2000), 1.0, 200, 32_768


@dataclass
class Record:
    """The fields shard reads (record_tokens takes len of the two): ranges, not token lists."""
    prompt_id: str
    prompt_tokens: range
    response_tokens: range


def draw(prompts: int, group: int, seed: int, *, mu: float = MU, sigma: float = SIGMA, prompt_sigma: float = 0.0,
         singles: int = 0) -> list[Record]:
    """prompts x group trajectories, each prompt's group contiguous, in the order a rollout buffer hands them, then
    `singles` one-record groups (offline / MC records, each of its own prompt)."""
    rng = random.Random(seed)
    out = []
    for p in range(prompts + singles):
        prompt = rng.randint(64, 2048)
        centre = mu + (rng.gauss(0.0, prompt_sigma) if prompt_sigma else 0.0)
        for _ in range(group if p < prompts else 1):
            n = min(HIGH, max(LOW, int(rng.lognormvariate(centre, sigma))))
            out.append(Record(f"p{p}", range(prompt), range(n)))
    return out


def best_deal(loads: list[int], bins: int, upper: int, max_nodes: int = 2_000_000) -> tuple[int, bool]:
    """The smallest maximum bin load of any deal of the items to `bins` non-empty bins, below `upper` (a deal's
    maximum, the answer when none beats it): (that maximum, proven: the search ran to its end)."""
    items = sorted(loads, reverse=True)
    floor = max(items[0], -(-sum(items) // bins))
    best, nodes = upper, 0
    cur = [0] * bins

    def visit(k: int, empty: int) -> bool:  # True: stop (the floor reached, or out of nodes)
        nonlocal best, nodes
        nodes += 1
        if k == len(items):
            best = max(cur)
            return best <= floor
        if nodes >= max_nodes:
            return True
        if len(items) - k < empty:
            return False
        seen = set()
        for b in sorted(range(bins), key=cur.__getitem__):
            if cur[b] + items[k] >= best:
                break  # the bins come lightest first: every later one is at least as heavy
            if cur[b] in seen:
                continue  # bins of equal load are interchangeable
            seen.add(cur[b])
            cur[b] += items[k]
            stop = visit(k + 1, empty - (cur[b] == items[k]))
            cur[b] -= items[k]
            if stop:
                return True
        return False

    visit(0, bins)
    return best, nodes < max_nodes


def round_robin(trajs: list, dp_rank: int, dp_size: int) -> list:
    """The old shard: whole prompt groups, the i-th group to rank i % dp_size."""
    groups: dict = {}
    for t in trajs:
        groups.setdefault(t.prompt_id, []).append(t)
    return [t for i, g in enumerate(groups.values()) if i % dp_size == dp_rank for t in g]


def rank_tokens(deal, trajs: list, dp_size: int) -> list[int]:
    return [sum(record_tokens(t) for t in deal(trajs, r, dp_size)) for r in range(dp_size)]


def measure(trajs: list, dp_size: int, exact: bool = False) -> dict:
    total = sum(record_tokens(t) for t in trajs)
    groups: dict = {}
    for t in trajs:
        groups[t.prompt_id] = groups.get(t.prompt_id, 0) + record_tokens(t)
    mean = total / dp_size
    old = rank_tokens(round_robin, trajs, dp_size)
    t0 = time.perf_counter()
    new = rank_tokens(shard, trajs, dp_size)
    seconds = (time.perf_counter() - t0) / dp_size  # one rank's shard call
    assert sum(new) == total and sum(old) == total
    lpt = [0] * dp_size  # the greedy alone, without the refinement pass
    for n, r in zip(groups.values(), deal_by_tokens(list(groups.values()), dp_size, refine=False)):
        lpt[r] += n
    row = {"dp": dp_size, "groups": len(groups), "mean_tokens": mean, "round_robin": max(old) / mean,
           "greedy_only": max(lpt) / mean, "by_tokens": max(new) / mean,
           "floor": max(max(groups.values()), mean) / mean, "largest_group_over_mean": max(groups.values()) / mean,
           "shard_ms": 1e3 * seconds}
    if exact:
        best, proven = best_deal(list(groups.values()), dp_size, max(new))
        row.update(best=best / mean, best_proven=proven)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (rollout.samples_per_prompt)")
    ap.add_argument("--dp", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--mu", type=float, default=MU)
    ap.add_argument("--sigma", type=float, default=SIGMA)
    ap.add_argument("--prompt-sigma", type=float, default=0.0)
    ap.add_argument("--singles", type=int, default=0, help="one-record groups after the prompt groups")
    ap.add_argument("--exact", action="store_true", help="the best deal there is too (branch and bound)")
    ap.add_argument("--bound", type=float, default=1.1, help="the issue's done-when: max / mean at most this")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    for seed in range(args.seeds):
        trajs = draw(args.prompts, args.group, seed, mu=args.mu, sigma=args.sigma, prompt_sigma=args.prompt_sigma,
                     singles=args.singles)
        for dp in args.dp:
            if args.prompts + args.singles < dp:
                rows.append({"dp": dp, "seed": seed, "skipped": f"{args.prompts + args.singles} prompt groups < "
                             f"DP {dp}: shard raises ConfigError (raise batch.sequences_per_step)"})
                continue
            rows.append({"seed": seed, **measure(trajs, dp, args.exact)})
    if args.json:
        print(json.dumps({"prompts": args.prompts, "group": args.group, "mu": args.mu, "sigma": args.sigma,
                          "prompt_sigma": args.prompt_sigma, "singles": args.singles, "clip": [LOW, HIGH],
                          "rows": rows}, indent=1))
        return 0
    print(f"{args.prompts} prompts x {args.group} responses: prompt U(64, 2048) tokens, response log-normal "
          f"mu={args.mu:.3f} sigma={args.sigma} (median {math.exp(args.mu):.0f}) clipped to {LOW}..{HIGH}"
          + (f", per-prompt log-median sd {args.prompt_sigma}" if args.prompt_sigma else "")
          + (f", then {args.singles} one-record groups" if args.singles else ""))
    print("max / mean tokens per rank (floor = max(largest group, total/DP) / mean: no deal of whole groups beats it)")
    print("(greedy only = longest-processing-time first without the refinement pass; by tokens = shard, both)")
    print(f"{'DP':>4} {'seed':>4} {'groups':>6} {'round-robin':>11} {'greedy only':>11} {'by tokens':>9} {'floor':>6} "
          f"{'shard ms':>8}" + (f" {'best':>6}" if args.exact else ""))
    for r in rows:
        if "skipped" in r:
            print(f"{r['dp']:>4} {r['seed']:>4}  skipped: {r['skipped']}")
            continue
        print(f"{r['dp']:>4} {r['seed']:>4} {r['groups']:>6} {r['round_robin']:>11.3f} {r['greedy_only']:>11.3f} "
              f"{r['by_tokens']:>9.3f} {r['floor']:>6.3f} {r['shard_ms']:>8.1f}"
              + (f" {r['best']:>6.3f}" + ("" if r["best_proven"] else " (search cut off: an upper bound)")
                 if args.exact else ""))
    for dp in args.dp:
        done = [r for r in rows if r["dp"] == dp and "skipped" not in r]
        if not done:
            continue
        worst_old, worst_new = max(r["round_robin"] for r in done), max(r["by_tokens"] for r in done)
        worst_floor = max(r["floor"] for r in done)
        worst_best = max(r["best"] for r in done) if args.exact else None
        mean_old = sum(r["round_robin"] for r in done) / len(done)
        mean_new = sum(r["by_tokens"] for r in done) / len(done)
        if worst_new <= args.bound:
            verdict = "meets"
        elif worst_floor > args.bound:
            verdict = "misses: the floor is over the bound (a group alone outweighs it), no deal can meet"
        elif worst_best is not None and worst_best > args.bound:
            verdict = "misses: no deal of whole groups meets it in the worst seed (exact search)"
        else:
            verdict = "misses: the greedy falls short (too few groups a rank for its moves)"
        print(f"DP {dp:>3}: round-robin mean {mean_old:.3f} worst {worst_old:.3f}; by tokens mean {mean_new:.3f} "
              f"worst {worst_new:.3f} (floor worst {worst_floor:.3f}"
              + (f", best deal worst {worst_best:.3f}" if worst_best is not None else "")
              + f"): {verdict} max/mean <= {args.bound}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
