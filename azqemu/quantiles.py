"""Quantiles of a sample, as numpy's default (linear) method gives them, without numpy's
``percentile``/``median``: their first call imports ``numpy.ma`` (``_median_nancheck``), which
the manager would then hold for good: 1.9 MiB of its anonymous memory, measured, a fifth of
what its first compressions leave behind (docs/figures.md, session 28)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def quantiles(values: np.ndarray, percents: Sequence[float]) -> list[float]:
    """The ``percents`` (0-100) quantiles of a non-empty sample: one sort, then numpy's
    'linear' interpolation between the two closest ranks."""
    s = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if not len(s):
        raise ValueError("quantiles of an empty sample")
    out = []
    for p in percents:
        if not 0.0 <= p <= 100.0:
            raise ValueError(f"percent out of 0-100: {p}")
        pos = p / 100.0 * (len(s) - 1)
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        out.append(float(s[lo] + (s[hi] - s[lo]) * (pos - lo)))
    return out
