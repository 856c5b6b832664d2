"""Pivotal token search (`megatron-spo pts`): Monte-Carlo success probabilities along successful trajectories.

For a response of T tokens, S(L) = P(success | prompt + response[:L]) under the reference policy, L = 0..T,
estimated by K rollouts from that prefix. S(T) is the trajectory's own outcome (1: it succeeded); S(0) is the
prompt's S0 (from an estimate-q0 file when given, else K rollouts). Bisection (Abdin et al. 2024, as in the
SPO paper 3.1.3): an interval (a, b) whose ends differ by at least ``threshold`` is split at m = (a + b) // 2
and S(m) is estimated; a length-1 interval with such a gap is a pivotal token: token a moves the success
probability from S(a) to S(a + 1). Intervals are handled level by level (a level's midpoints are estimated
concurrently); under a rollout budget the level's largest gaps go first. Without the budget binding, the
estimated set equals plain recursive bisection.

Output: each searched trajectory with mc_targets [{t: L - 1, success_prob: S(L)}] for every estimated
0 < L < T (S after response token t, trajectory.py's convention), source "mc", for the `mc` objective.

    megatron-spo pts --engine-url URL --task toy --trajectories ok.jsonl --q0 q0.jsonl --out mc.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_spo.config import build_config
from megatron_spo.data.q0 import read_q0
from megatron_spo.data.result_log import ResultLog
from megatron_spo.data.trajectory import Trajectory, validate_record
from megatron_spo.engine_tools.command_line import (
    add_sampling_args,
    add_task_args,
    apply_train_config,
    close_reward_pool,
    load_tokenizer,
    problems_from_args,
    reward_pool_from_args,
    run_cli,
    sampling_from_args,
)
from megatron_spo.engine_tools.config import PTSConfig, ToolSamplingConfig
from megatron_spo.engine_tools.sampling import gather_or_cancel, run_resumable, sample, score_all

GAP_TOLERANCE = 1e-9  # |0.3 - 0.1| is 0.19999999999999998 in floats: a gap of exactly threshold recurses


# ---------------------------------------------------------------------------------------------
# The bisection (pure: no I/O)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PivotalToken:
    t: int  # 0-based response index of the token
    s_before: float  # S(t): success probability before the token
    s_after: float  # S(t + 1): after it


@dataclass
class BisectionSearch:
    """The search over prefix lengths 0..length. Drive it with next_points() / record() until next_points()
    returns []; ``estimates`` then maps every visited prefix length to S, ``pivotal`` lists the pivotal tokens.

    max_estimates bounds the number of points estimated (the ends are given).
    """

    length: int
    s_start: float
    s_end: float
    threshold: float
    max_estimates: int
    estimates: dict[int, float] = field(init=False)
    pivotal: list[PivotalToken] = field(init=False, default_factory=list)
    truncated: bool = field(init=False, default=False)  # the budget cut the search short

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ValueError(f"BisectionSearch: length must be >= 1 response token, got {self.length}")
        for name in ("s_start", "s_end"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"BisectionSearch: {name} must be a probability, got {getattr(self, name)}")
        self.estimates = {0: self.s_start, self.length: self.s_end}
        self._frontier = [(0, self.length)]
        self._pending: list[tuple[int, int]] = []

    def gap(self, a: int, b: int) -> float:
        return abs(self.estimates[b] - self.estimates[a])

    def next_points(self) -> list[int]:
        """Prefix lengths to estimate next (one bisection level); [] when the search is over."""
        if self._pending:
            raise RuntimeError("BisectionSearch: record() the previous points first")
        split = []
        for a, b in self._frontier:
            if self.gap(a, b) < self.threshold - GAP_TOLERANCE:
                continue
            if b - a == 1:
                self.pivotal.append(PivotalToken(a, self.estimates[a], self.estimates[b]))
            else:
                split.append((a, b))
        self._frontier = []
        split.sort(key=lambda ab: (-self.gap(*ab), ab[0]))
        budget = self.max_estimates - (len(self.estimates) - 2)
        if len(split) > budget:
            self.truncated = True
            split = split[:max(budget, 0)]
        self._pending = sorted(split)
        if not self._pending:
            self.pivotal.sort(key=lambda p: p.t)
        return [(a + b) // 2 for a, b in self._pending]

    def record(self, values: Sequence[float]) -> None:
        """S at the points of the last next_points(), in that order."""
        if len(values) != len(self._pending):
            raise ValueError(f"BisectionSearch: {len(values)} values for {len(self._pending)} points")
        for (a, b), value in zip(self._pending, values):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"BisectionSearch: S({(a + b) // 2}) = {value} is not a probability")
            mid = (a + b) // 2
            self.estimates[mid] = float(value)
            self._frontier += [(a, mid), (mid, b)]
        self._pending = []

    def mc_targets(self) -> list[dict]:
        """[{t, success_prob}] for every estimated interior prefix length L (t = L - 1), by t."""
        return [{"t": n - 1, "success_prob": s} for n, s in sorted(self.estimates.items()) if 0 < n < self.length]


def bisect_oracle(length: int, oracle: Callable[[int], float], *, s_start: float | None = None,
                  s_end: float = 1.0, threshold: float = 0.2, max_estimates: int = 1 << 30) -> BisectionSearch:
    """Run the search against a function prefix length -> S (tests, and exact oracles)."""
    search = BisectionSearch(length, oracle(0) if s_start is None else s_start, s_end, threshold, max_estimates)
    while points := search.next_points():
        search.record([oracle(n) for n in points])
    return search


# ---------------------------------------------------------------------------------------------
# Against engines
# ---------------------------------------------------------------------------------------------
def trajectory_key(record: Mapping[str, Any]) -> str:
    """Identity of a trajectory (prompt and response), the resume key of the pts output."""
    blob = json.dumps([str(record["prompt_id"]), record["prompt_tokens"], record["response_tokens"]])
    return hashlib.sha1(blob.encode()).hexdigest()[:20]


@dataclass
class PTSReport:
    """records: the annotated trajectories (this run's and earlier runs'), in input order. searched /
    rollouts / pivotal cover this run only. skipped_failed and duplicates: inputs not searched."""

    records: list[dict]
    searched: int = 0
    rollouts: int = 0
    truncated: int = 0
    skipped_failed: int = 0
    duplicates: int = 0
    pivotal: dict[str, list[PivotalToken]] = field(default_factory=dict)


async def pivotal_token_search(trajectories: Sequence[Any], problems: Mapping[str, Any], client: Any,
                               reward_pool: Any, decode: Callable[[list[int]], str], *,
                               rollouts_per_point: int = 10, threshold: float = 0.2, max_rollouts: int = 200,
                               success_reward: float = 0.0, source: str = "mc",
                               sampling: ToolSamplingConfig | None = None, s0: Mapping[str, float] | None = None,
                               q0: Mapping[str, float] | None = None, out_path: str | Path | None = None,
                               progress: bool = False) -> PTSReport:
    """Annotate the successful trajectories (Trajectory objects or record dicts) with mc_targets.

    problems: prompt_id -> problem (what reward_pool.score needs). decode: token ids -> text, used on
    prefix + continuation so the scored text is exactly the tokens'. s0 / q0: prompt_id -> S0 / Q0 from
    estimate-q0 (S0 then costs no rollouts; Q0 goes into the record's q0).
    """
    cfg = build_config(PTSConfig, {"rollouts_per_point": rollouts_per_point, "threshold": threshold,
                                   "max_rollouts": max_rollouts, "success_reward": success_reward, "source": source,
                                   "sampling": (sampling or ToolSamplingConfig(samples_per_request=16)).model_dump()})
    report = PTSReport(records=[])
    items, seen = [], set()
    for i, traj in enumerate(trajectories):
        rec = (traj if isinstance(traj, Trajectory) else validate_record(traj, f"trajectory {i}")).to_dict()
        if rec["reward"] < cfg.success_reward:
            report.skipped_failed += 1
            continue
        key = trajectory_key(rec)
        if key in seen:
            report.duplicates += 1
            continue
        seen.add(key)
        if str(rec["prompt_id"]) not in problems:
            raise ValueError(f"trajectory {i}: prompt_id '{rec['prompt_id']}' is not among the task's problems")
        items.append(rec)
    log = ResultLog(out_path, key=trajectory_key) if out_path is not None else None
    k = cfg.rollouts_per_point

    async def work(rec: dict) -> dict:
        key, pid = trajectory_key(rec), str(rec["prompt_id"])
        prompt, response = list(rec["prompt_tokens"]), list(rec["response_tokens"])
        problem = problems[pid]

        async def estimate(n: int) -> float:
            prefix = response[:n]
            completions = await sample(client, prompt + prefix, k, cfg.sampling, seed_key=(key, n))
            results = await score_all(reward_pool, problem, [decode(prefix + c.output_ids) for c in completions])
            report.rollouts += k
            return sum(r.passed for r in results) / k

        budget = cfg.max_rollouts // k
        start = None if s0 is None else s0.get(pid)
        if start is None:
            start, budget = await estimate(0), budget - 1
        search = BisectionSearch(len(response), start, 1.0, cfg.threshold, budget)
        while points := search.next_points():
            search.record(await gather_or_cancel([estimate(n) for n in points]))
        report.searched += 1
        report.truncated += search.truncated
        report.pivotal[key] = search.pivotal
        out = {**rec, "source": cfg.source, "mc_targets": search.mc_targets()}
        if q0 is not None and pid in q0:
            out["q0"] = q0[pid]
        return out

    try:
        done = await run_resumable(items, trajectory_key, work, log, concurrency=cfg.sampling.concurrency,
                                   description="pts", progress=progress)
    finally:
        if log is not None:
            log.close()
    report.records = list(done.values())
    return report


def main(argv: list[str]) -> int:
    defaults = PTSConfig()
    parser = argparse.ArgumentParser(prog="megatron-spo pts",
                                     description="Pivotal token search: MC-annotated trajectories for the mc objective.")
    add_task_args(parser, default_split="train")
    parser.add_argument("--trajectories", required=True, help="input trajectories (JSONL or offline store)")
    parser.add_argument("--out", required=True, help="annotated trajectories JSONL (resumable)")
    parser.add_argument("--q0", default=None, help="estimate-q0 output: S0 per prompt (saves rollouts) and Q0")
    parser.add_argument("--rollouts-per-point", "-k", type=int, default=defaults.rollouts_per_point)
    parser.add_argument("--threshold", type=float, default=defaults.threshold)
    parser.add_argument("--max-rollouts", type=int, default=defaults.max_rollouts, help="budget per trajectory")
    parser.add_argument("--success-reward", type=float, default=defaults.success_reward)
    parser.add_argument("--source", default=defaults.source)
    add_sampling_args(parser, defaults.sampling)
    args = parser.parse_args(argv)
    apply_train_config(args, parser)
    cfg = build_config(PTSConfig, {
        "rollouts_per_point": args.rollouts_per_point, "threshold": args.threshold, "max_rollouts": args.max_rollouts,
        "success_reward": args.success_reward, "source": args.source, "sampling": sampling_from_args(args)})

    async def body() -> int:
        from megatron_spo.data.offline_store import load_trajectories
        from megatron_spo.rollout.client import EngineClient

        trajectories = load_trajectories(args.trajectories)
        problems = problems_from_args(args)
        tokenizer = load_tokenizer(args.tokenizer, args.engine_url)
        by_id = {str(p.id): p for p in problems}
        estimates = read_q0(args.q0) if args.q0 else None
        pool = reward_pool_from_args(args, problems, prog="pts")
        try:
            async with EngineClient(args.engine_url, timeout_s=args.request_timeout) as client:
                report = await pivotal_token_search(
                    trajectories, by_id, client, pool, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    rollouts_per_point=cfg.rollouts_per_point, threshold=cfg.threshold,
                    max_rollouts=cfg.max_rollouts, success_reward=cfg.success_reward, source=cfg.source,
                    sampling=cfg.sampling, s0={k: e.s0 for k, e in estimates.items()} if estimates else None,
                    q0={k: e.q0 for k, e in estimates.items()} if estimates else None, out_path=args.out,
                    progress=not args.no_progress)
        finally:
            close_reward_pool(pool)
        pivotal = sum(len(v) for v in report.pivotal.values())
        print(f"pts: {len(report.records)} annotated trajectories -> {args.out} (this run: {report.searched} searched, "
              f"{report.rollouts} rollouts, {pivotal} pivotal tokens, {report.truncated} cut by the budget); "
              f"skipped {report.skipped_failed} unsuccessful and {report.duplicates} duplicate inputs")
        return 0

    return run_cli("megatron-spo pts", body)
