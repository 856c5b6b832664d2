"""megatron_spo.eval.pass_at_k: the unbiased estimator against exact fractions, arrays, extremes."""

from __future__ import annotations

import math
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest

from megatron_spo.eval import pass_at_k


def exact(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize(
    "n,c,k",
    [(1, 0, 1), (1, 1, 1), (20, 0, 1), (20, 3, 1), (20, 3, 10), (20, 10, 10), (20, 11, 10), (20, 20, 10),
     (200, 1, 100), (1000, 7, 10), (10_000, 1, 1), (10_000, 3, 1000), (10_000, 5_000, 100), (10_000, 9_999, 1)],
)  # fmt: skip
def test_matches_exact_fraction(n, c, k):
    got = pass_at_k(n, c, k)
    assert isinstance(got, float)
    assert got == pytest.approx(float(exact(n, c, k)), rel=1e-12, abs=1e-15)


def test_known_values():
    assert pass_at_k(20, 3, 1) == pytest.approx(3 / 20, rel=1e-15)  # pass@1 is the success rate
    assert pass_at_k(20, 0, 10) == 0.0
    assert pass_at_k(20, 11, 10) == 1.0  # fewer than k failures: a success is certain


def test_arrays_broadcast_and_keep_shape():
    n = np.array([[20, 20], [10_000, 50]])
    c = np.array([[3, 0], [17, 50]])
    got = pass_at_k(n, c, 10)
    assert got.shape == (2, 2) and got.dtype == np.float64
    for idx in np.ndindex(2, 2):
        assert got[idx] == pytest.approx(float(exact(int(n[idx]), int(c[idx]), 10)), rel=1e-12, abs=1e-15)
    assert pass_at_k(20, [0, 1, 2], [1, 1, 1]).tolist() == pytest.approx([0.0, 0.05, 0.1], rel=1e-15)


def test_stable_where_naive_binomials_overflow():
    # C(10000, 5000) has ~3000 digits: as floats the naive ratio is inf/inf.
    got = pass_at_k(10_000, 20, 5_000)
    assert math.isfinite(got)
    assert got == pytest.approx(float(exact(10_000, 20, 5_000)), rel=1e-12)


@pytest.mark.parametrize(
    "args,message",
    [
        ((20, 3, 0), r"pass_at_k: k must be >= 1 \(n=20, c=3, k=0\)"),
        ((20, 3, 21), r"pass_at_k: k must be <= n \(n=20, c=3, k=21\)"),
        ((20, 21, 1), r"pass_at_k: c must be <= n \(n=20, c=21, k=1\)"),
        (([20, 20], [3, -1], 1), r"pass_at_k: c must be >= 0 at index \(1,\) \(n=20, c=-1, k=1\)"),
        ((20, 2.5, 1), r"pass_at_k: c must be integer, got 2.5"),
    ],
)
def test_bad_input_names_the_problem(args, message):
    with pytest.raises(ValueError, match=message):
        pass_at_k(*args)


def test_import_is_light():
    code = "import sys, megatron_spo.eval as e; e.pass_at_k(2, 1, 1); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
