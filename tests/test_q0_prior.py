"""Q0 from few samples (issue 62): S0 as the posterior mean under Jeffreys' Beta(1/2, 1/2) prior, its 95% interval, the
warning when most prompts rest on few samples, and records whose q0 is of another beta or reference recomputed from
this run's table or refused in one line."""

import math

import pytest

from megatron_spo.config import ConfigError
from megatron_spo.data.q0 import (
    PAPER_BETA,
    few_samples_warning,
    q0_basis,
    q0_from_counts,
    reference_identity,
)


def test_zero_of_twelve_is_no_longer_minus_one_and_800_samples_keep_the_plain_rate():
    plain, smoothed = q0_from_counts(0, 12, PAPER_BETA, prior=0), q0_from_counts(0, 12, PAPER_BETA)
    assert (plain.s0, plain.q0) == (0.0, -1.0)  # the rule before: 11.5 nats of lift asked of every success
    assert smoothed.s0 == pytest.approx(0.5 / 13, rel=1e-12)
    assert smoothed.q0 == pytest.approx(PAPER_BETA * math.log(0.5 / 13 + (12.5 / 13) * math.exp(-1 / PAPER_BETA)),
                                        rel=1e-12)
    assert smoothed.q0 == pytest.approx(-0.283, abs=1e-3)
    # 800 samples (the paper's): the prior is within 1e-3 of the plain rate's S0
    for correct in (0, 3, 400, 800):
        assert abs(q0_from_counts(correct, 800, PAPER_BETA).s0 - correct / 800) < 1e-3
    with pytest.raises(ValueError, match="q0: 13 successes of 12 samples"):
        q0_from_counts(13, 12, PAPER_BETA)


def test_the_interval_is_jeffreys_and_holds_the_estimate():
    scipy_stats = pytest.importorskip("scipy.stats")
    from megatron_spo.algorithms import q0_from_success

    for correct, n in ((0, 12), (1, 12), (6, 12), (12, 12), (3, 800)):
        e = q0_from_counts(correct, n, PAPER_BETA)
        lo, hi = scipy_stats.beta.ppf([0.025, 0.975], correct + 0.5, n - correct + 0.5)
        assert e.q0_low == pytest.approx(float(q0_from_success(lo, PAPER_BETA)), abs=1e-9)
        assert e.q0_high == pytest.approx(float(q0_from_success(hi, PAPER_BETA)), abs=1e-9)
        assert e.q0_low < e.q0 < e.q0_high
    assert q0_from_counts(0, 12, PAPER_BETA).q0_low == pytest.approx(-0.860, abs=1e-3)


def test_few_samples_warn_in_one_line_and_many_do_not():
    few = {f"p{i}": q0_from_counts(i % 3, 12, PAPER_BETA) for i in range(10)}
    line = few_samples_warning(few, PAPER_BETA)
    assert line.startswith("warning: Q0 of 10 of 10 prompts rests on fewer than 100 samples (median 95% interval ")
    assert "\n" not in line and "800" in line
    assert few_samples_warning({f"p{i}": q0_from_counts(i, 800, PAPER_BETA) for i in range(10)}, PAPER_BETA) is None


def _archive(tmp_path, beta: float, reference: str):
    """An experience archive (data/archive.py) of two online trajectories with q0, written by a run at ``beta``."""
    from types import SimpleNamespace

    from megatron_spo.data.archive import ExperienceArchive

    path = tmp_path / "experience"
    archive = ExperienceArchive(path, run_id="earlier", q0_basis=q0_basis(beta, reference))
    archive.add(SimpleNamespace(prompt_id=p, prompt_tokens=[1, 2], response_tokens=[3, 4], reward=0.0,
                                policy_version=1, behaviour_logprobs=None, q0=-0.25) for p in ("a", "b"))
    archive.close()
    return str(path)


def test_a_record_with_another_runs_q0_is_recomputed_or_refused_in_one_line(tmp_path):
    from megatron_spo.training.sources import OfflineSource

    ref = reference_identity(None, str(tmp_path))
    store = _archive(tmp_path, beta=0.5, reference=ref)
    table = {"a": -0.6, "b": -0.7}
    same = OfflineSource("exp", store, seed=0, q0=table, needs_q0=True, q0_basis=(0.5, ref))
    assert sorted(r.q0 for r in same.records) == [-0.25, -0.25]  # its own basis: kept
    other_beta = OfflineSource("exp", store, seed=0, q0=table, needs_q0=True, q0_basis=(PAPER_BETA, ref))
    assert sorted(r.q0 for r in other_beta.records) == [-0.7, -0.6]  # recomputed: this run's Q0 of their prompts
    other_ref = OfflineSource("exp", store, seed=0, q0=table, needs_q0=True, q0_basis=(0.5, "sha1:0123"))
    assert sorted(r.q0 for r in other_ref.records) == [-0.7, -0.6]
    with pytest.raises(ConfigError) as err:  # no Q0 of theirs in this run's table: refused
        OfflineSource("exp", store, seed=0, q0={"a": -0.6}, needs_q0=True, q0_basis=(PAPER_BETA, ref))
    assert str(err.value).startswith(f"sources.exp ({store}): 1 record(s) carry a q0 of beta 0.5, reference {ref} "
                                     f"(first: prompt 'b'), not this run's (beta {PAPER_BETA:g}")
    assert "\n" not in str(err.value)
