"""Q0 per prompt as data: S0 = fraction of the reference samples scored correct; Q0 = beta * log(S0 + (1 - S0)
exp(-1/beta)) (SPO paper 3.1.3, MATH.md). `megatron-spo estimate-q0` (engine_tools/estimate_q0.py) writes the
file read_q0 reads: {prompt_id, s0, q0, n, correct, beta} per line.

    est = read_q0("q0.jsonl")
    est["num-001"].s0, est["num-001"].q0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_spo.data.result_log import ResultLog

# The SPO paper's KL strength, 1/log(1e5) ~ 0.0869. Q0 is a soft value at beta, so a Q0 file and the training
# that reads it must share beta: the trainer and the tools take this one default.
PAPER_BETA = 1.0 / math.log(100000.0)


@dataclass(frozen=True)
class Q0Estimate:
    """S0: success rate of n reference samples (correct of n); Q0: the soft value at beta."""

    s0: float
    q0: float
    n: int
    correct: int


def q0_from_counts(correct: int, n: int, beta: float) -> Q0Estimate:
    from megatron_spo.algorithms import q0_from_success

    s0 = correct / n
    return Q0Estimate(s0=s0, q0=float(q0_from_success(s0, beta)), n=n, correct=correct)


def read_q0(path: str | Path, beta: float | None = None) -> dict[str, Q0Estimate]:
    """prompt_id -> Q0Estimate from an estimate-q0 output file.

    beta: Q0 at this beta, derived from each record's counts (S0 does not depend on beta, so a file sampled at one
    beta serves a trainer at another); None: the file's own q0 values, which must all be at one beta.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"q0 file '{path}' not found")
    records, _ = ResultLog.read(path, lambda r: str(r["prompt_id"]))
    try:
        if beta is not None:
            return {key: q0_from_counts(r["correct"], r["n"], beta) for key, r in records.items()}
        betas = sorted({r["beta"] for r in records.values() if r.get("beta") is not None})
        if len(betas) > 1:
            raise ValueError(f"{path}: q0 values at several betas {betas} (a resumed estimate at another beta); "
                             "read it at one beta (read_q0(path, beta=...))")
        return {key: Q0Estimate(r["s0"], r["q0"], r["n"], r["correct"]) for key, r in records.items()}
    except KeyError as err:
        raise ValueError(f"{path}: not an estimate-q0 output (a record lacks {err})") from None


ESTIMATE_HINT = "run `megatron-spo estimate-q0 CONFIG --out q0.jsonl` and set task.q0_path: q0.jsonl"


def q0_table(path: str | Path | None, beta: float) -> dict[str, float] | None:
    """prompt_id -> Q0 at ``beta`` from an estimate-q0 file; None when there is no file (path None)."""
    if path is None:
        return None
    return {pid: est.q0 for pid, est in read_q0(path, beta=beta).items()}


def fill_missing_q0(records: list, table: dict[str, float] | None, *, where: str, q0_path: str | None) -> int:
    """Give every record without q0 its prompt's Q0 from ``table`` (in place); returns how many were filled.
    A record whose prompt the table lacks (or no table at all) is a ValueError, one line naming ``where`` (the
    source), the file and the first such prompt id: a Q0 of 0 would be the largest value rewards in {0, -1} allow,
    not a neutral one."""
    lacking = [r for r in records if r.q0 is None]
    if not lacking:
        return 0
    if table is None:
        raise ValueError(f"{where}: {len(lacking)} of {len(records)} records have no q0 (first: prompt "
                         f"'{lacking[0].prompt_id}') and task.q0_path is not set; {ESTIMATE_HINT}")
    unknown = sorted({str(r.prompt_id) for r in lacking if str(r.prompt_id) not in table})
    if unknown:
        raise ValueError(f"{where}: {len(unknown)} prompt(s) of records without q0 are not in task.q0_path "
                         f"{q0_path} (first: '{unknown[0]}'); estimate Q0 for them (megatron-spo estimate-q0)")
    for r in lacking:
        r.q0 = table[str(r.prompt_id)]
    return len(lacking)
