"""The unbiased pass@k estimator (Chen et al., 2021): 1 - C(n - c, k) / C(n, k).

Computed as 1 - prod_{i = n - c + 1}^{n} (1 - k / i), a product of numbers in [0, 1]: no huge binomials,
exact to float rounding for n up to 10,000 and beyond. numpy only, no torch.
"""

from __future__ import annotations

import numpy as np


def _pass_at_k_scalar(n: int, c: int, k: int) -> float:
    if n - c < k:
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def pass_at_k(n, c, k):
    """Probability that at least one of k samples, drawn without replacement from n samples of which c
    are correct, is correct. n, c, k: ints or integer arrays (broadcast together). Returns a float for
    scalar inputs, else a float64 array.
    """
    n_arr, c_arr, k_arr = (np.asarray(v) for v in (n, c, k))
    for name, arr in (("n", n_arr), ("c", c_arr), ("k", k_arr)):
        if arr.dtype.kind not in "iu" and not (arr.dtype.kind == "f" and np.all(arr == np.round(arr))):
            raise ValueError(f"pass_at_k: {name} must be integer, got {arr.tolist()!r}")
    n_arr, c_arr, k_arr = (a.astype(np.int64) for a in (n_arr, c_arr, k_arr))
    n_b, c_b, k_b = np.broadcast_arrays(n_arr, c_arr, k_arr)
    problems = [
        (k_b < 1, "k must be >= 1"),
        (k_b > n_b, "k must be <= n"),
        (c_b < 0, "c must be >= 0"),
        (c_b > n_b, "c must be <= n"),
    ]
    for bad, message in problems:
        if np.any(bad):
            where = tuple(int(i) for i in np.argwhere(bad)[0]) if bad.ndim else ()
            at = f" at index {where}" if where else ""
            raise ValueError(
                f"pass_at_k: {message}{at} (n={int(n_b[where])}, c={int(c_b[where])}, k={int(k_b[where])})"
            )
    out = np.array(
        [_pass_at_k_scalar(int(a), int(b), int(d)) for a, b, d in zip(n_b.ravel(), c_b.ravel(), k_b.ravel())]
    )
    if n_b.ndim == 0:
        return float(out[0])
    return out.reshape(n_b.shape)
