"""Q0 per prompt as data: S0 = the success rate of the reference's samples; Q0 = beta * log(S0 + (1 - S0)
exp(-1/beta)) (SPO paper 3.1.3, MATH.md). `megatron-spo estimate-q0` (engine_tools/estimate_q0.py) writes the
file read_q0 reads: {prompt_id, s0, q0, n, correct, beta, prior, q0_low, q0_high} per line.

S0 from few samples: the plain rate correct / n gives a prompt with 0 of 12 successes S0 = 0 and Q0 = -1 exactly,
asking SPO to lift each of its successes exp(1 / beta) = 1e5 times over pi_0 (11.5 nats), on the evidence of 12
samples. The estimate is the posterior mean of S0 under a Beta(prior, prior) prior (default 1/2: Jeffreys'),
(correct + prior) / (n + 2 prior): 0 of 12 gives S0 = 0.038, Q0 = -0.283 (3.3 nats); at the paper's 800 samples
it is within 1e-3 of the plain rate. prior 0 is the plain rate. The 95% interval is Jeffreys' (the equal-tailed one
of the Beta(correct + 1/2, n - correct + 1/2) posterior), mapped through the monotone Q0(S0).

    est = read_q0("q0.jsonl")
    est["num-001"].s0, est["num-001"].q0, est["num-001"].q0_low
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from megatron_spo.data.result_log import ResultLog

# The SPO paper's KL strength, 1/log(1e5) ~ 0.0869. Q0 is a soft value at beta, so a Q0 file and the training
# that reads it must share beta: the trainer and the tools take this one default.
PAPER_BETA = 1.0 / math.log(100000.0)


# The prior on each prompt's success rate: Beta(a, a), Jeffreys' a = 1/2 (module docstring); 0: the plain rate.
Q0_PRIOR = 0.5
INTERVAL = 0.95
FEW_SAMPLES = 100  # estimate-q0 warns when most prompts rest on fewer


@dataclass(frozen=True)
class Q0Estimate:
    """S0: the success rate estimated from ``correct`` of n reference samples (the posterior mean under a Beta(prior,
    prior) prior); Q0: the soft value at beta; q0_low, q0_high: Q0's 95% interval (Jeffreys' interval of S0)."""

    s0: float
    q0: float
    n: int
    correct: int
    q0_low: float | None = None
    q0_high: float | None = None
    prior: float = Q0_PRIOR


def q0_from_counts(correct: int, n: int, beta: float, prior: float = Q0_PRIOR) -> Q0Estimate:
    from megatron_spo.algorithms import q0_from_success

    if n <= 0 or not 0 <= correct <= n:
        raise ValueError(f"q0: {correct} successes of {n} samples")
    if prior < 0:
        raise ValueError(f"q0: the prior must be >= 0, got {prior}")
    s0 = (correct + prior) / (n + 2 * prior)
    a, b = correct + 0.5, n - correct + 0.5  # Jeffreys' interval, whatever the estimate's prior
    tail = (1 - INTERVAL) / 2
    low, high = beta_quantile(tail, a, b), beta_quantile(1 - tail, a, b)
    q = lambda s: float(q0_from_success(s, beta))  # noqa: E731
    return Q0Estimate(s0=s0, q0=q(s0), n=n, correct=correct, q0_low=q(low), q0_high=q(high), prior=prior)


def beta_cdf(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b) (Numerical Recipes' continued fraction, Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the continued fraction converges fast below the mean
        return 1.0 - beta_cdf(1 - x, b, a)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(log_front) * f / a


def beta_quantile(p: float, a: float, b: float) -> float:
    """x with I_x(a, b) = p (bisection: I_x is increasing; 60 halvings reach double precision)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if beta_cdf(mid, a, b) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def q0_basis(beta: float, reference: str) -> str:
    """What a record's q0 is a soft value of (Provenance.q0_basis): its beta and its reference's identity."""
    return f"beta={beta!r} reference={reference}"


def reference_identity(init_megatron: str | None, init_hf: str | None) -> str:
    """The run's reference (its init model: pi_0) as a string two runs of the same weights share: the sha1 of the
    checkpoint's digests.json (checkpoint_digest.py: the files' content hashes) where it has one, else its path."""
    import hashlib

    for folder in (init_megatron, init_hf):
        if folder is None:
            continue
        digests = Path(folder) / "digests.json"
        if digests.is_file():
            return "sha1:" + hashlib.sha1(digests.read_bytes()).hexdigest()[:16]
        return "path:" + str(Path(folder).resolve())
    return "none"


def refresh_foreign_q0(records: list, table: dict[str, float] | None, *, beta: float, reference: str,
                       where: str) -> int:
    """Records whose q0 was taken at another beta or from another reference (Provenance.q0_basis, written by the
    experience archive) get their prompt's Q0 of this run from ``table`` (task.q0_path); one whose prompt the table
    lacks is a ValueError naming ``where``, the record's basis and the run's. Returns how many were recomputed.
    Records without a basis (imports, older archives) keep their q0."""
    foreign = []
    for r in records:
        basis = getattr(getattr(r, "provenance", None), "q0_basis", None)
        if r.q0 is None or basis is None:
            continue
        b, ref = parse_q0_basis(basis)
        if not math.isclose(b, beta, rel_tol=1e-9) or ref != reference:
            foreign.append((r, b, ref))
    lacking = [(r, b, ref) for r, b, ref in foreign if table is None or str(r.prompt_id) not in table]
    if lacking:
        r, b, ref = lacking[0]
        raise ValueError(f"{where}: {len(lacking)} record(s) carry a q0 of beta {b:g}, reference {ref} (first: prompt "
                         f"'{r.prompt_id}'), not this run's (beta {beta:g}, reference {reference}), and task.q0_path "
                         f"has no Q0 of their prompts; estimate it (megatron-spo estimate-q0) or train at their beta")
    for r, _, _ in foreign:
        r.q0 = table[str(r.prompt_id)]
    return len(foreign)


def parse_q0_basis(basis: str) -> tuple[float, str]:
    """(beta, reference) of a q0_basis string."""
    head, _, reference = basis.partition(" reference=")
    if not head.startswith("beta=") or not reference:
        raise ValueError(f"q0_basis {basis!r} is not 'beta=B reference=R'")
    return float(head[len("beta="):]), reference


def read_q0(path: str | Path, beta: float | None = None, prior: float | None = None) -> dict[str, Q0Estimate]:
    """prompt_id -> Q0Estimate from an estimate-q0 output file.

    beta: Q0 at this beta, derived from each record's counts (S0 does not depend on beta, so a file sampled at one
    beta serves a trainer at another) with ``prior`` (None: Q0_PRIOR); beta None: the file's own q0 values, which
    must all be at one beta.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"q0 file '{path}' not found")
    records, _ = ResultLog.read(path, lambda r: str(r["prompt_id"]))
    try:
        if beta is not None:
            prior = Q0_PRIOR if prior is None else prior
            return {key: q0_from_counts(r["correct"], r["n"], beta, prior) for key, r in records.items()}
        betas = sorted({r["beta"] for r in records.values() if r.get("beta") is not None})
        if len(betas) > 1:
            raise ValueError(f"{path}: q0 values at several betas {betas} (a resumed estimate at another beta); "
                             "read it at one beta (read_q0(path, beta=...))")
        return {key: Q0Estimate(r["s0"], r["q0"], r["n"], r["correct"], r.get("q0_low"), r.get("q0_high"),
                                r.get("prior", 0.0)) for key, r in records.items()}
    except KeyError as err:
        raise ValueError(f"{path}: not an estimate-q0 output (a record lacks {err})") from None


ESTIMATE_HINT = "run `megatron-spo estimate-q0 CONFIG --out q0.jsonl` and set task.q0_path: q0.jsonl"


def q0_table(path: str | Path | None, beta: float, prior: float | None = None) -> dict[str, float] | None:
    """prompt_id -> Q0 at ``beta`` (and ``prior``) from an estimate-q0 file; None when there is no file (path None)."""
    if path is None:
        return None
    return {pid: est.q0 for pid, est in read_q0(path, beta=beta, prior=prior).items()}


def few_samples_warning(estimates: dict[str, Q0Estimate], beta: float) -> str | None:
    """One line when most prompts' Q0 rests on fewer than FEW_SAMPLES samples: their share, the median width of
    Q0's 95% interval in nats (/ beta) and the paper's 800; None otherwise."""
    few = [e for e in estimates.values() if e.n < FEW_SAMPLES]
    if not estimates or 2 * len(few) <= len(estimates):
        return None
    widths = sorted((e.q0_high - e.q0_low) / beta for e in few if e.q0_low is not None and e.q0_high is not None)
    median = widths[len(widths) // 2] if widths else float("nan")
    return (f"warning: Q0 of {len(few)} of {len(estimates)} prompts rests on fewer than {FEW_SAMPLES} samples "
            f"(median 95% interval {median:.1f} nats wide; the SPO paper took 800 per prompt): raise --samples, or "
            f"train with a centred source, whose gradient does not depend on Q0 (docs/spo-stability.md)")


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
