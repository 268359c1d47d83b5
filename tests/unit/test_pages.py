"""Page-run helpers of the ground-level ``azqemu.pages``."""

from __future__ import annotations

import numpy as np

from azqemu.pages import page_runs


def test_page_runs() -> None:
    starts, lengths = page_runs(np.array([1, 2, 3, 7, 9, 10]))
    assert starts.tolist() == [1, 7, 9] and lengths.tolist() == [3, 1, 2]
    starts, lengths = page_runs(np.array([], dtype=np.int64))
    assert len(starts) == 0
