"""Quantiles without numpy's percentile (which loads numpy.ma into the manager for good)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from azqemu.quantiles import quantiles

PERCENTS = (0, 1, 25, 50, 90, 99, 99.9, 100)


@given(arrays(np.float64, st.integers(1, 300), elements=st.floats(-1e9, 1e9)))
def test_quantiles_are_numpys_linear_ones(values: np.ndarray) -> None:
    assert quantiles(values, PERCENTS) == pytest.approx(np.percentile(values, PERCENTS).tolist(), rel=1e-9, abs=1e-6)


def test_integer_samples_and_bad_input() -> None:
    assert quantiles(np.array([3, 1, 2, 4], dtype=np.uint64), (50, 100)) == [2.5, 4.0]
    assert quantiles(np.array([7]), (0, 50, 100)) == [7.0, 7.0, 7.0]
    with pytest.raises(ValueError, match="empty"):
        quantiles(np.empty(0), (50,))
    with pytest.raises(ValueError, match="0-100"):
        quantiles(np.arange(3), (101,))


def test_the_daemon_does_not_load_numpy_ma() -> None:
    """The daemon's modules, and the fault figures it computes, leave numpy.ma unloaded."""
    code = ("import sys, numpy as np\n"
            "import azqemu.daemon.server, azqemu.daemon.memstats, azqemu.restore.handler\n"
            "from azqemu.quantiles import quantiles\n"
            "quantiles(np.arange(100, dtype=np.uint64), (50, 90, 99))\n"
            "print('numpy.ma' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
