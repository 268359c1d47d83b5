"""The record of incompressible pages a compression left resident."""

from __future__ import annotations

import numpy as np

from azqemu.daemon.coldrule import CopyHistory
from azqemu.daemon.rawrecord import RawRecord


def test_a_page_counts_as_raw_only_with_the_content_it_was_tried_with() -> None:
    rec = RawRecord.of(np.array([40, 7, 19]), np.array([4, 1, 2], dtype=np.uint64), np.array([40, 10, 20], dtype=np.uint64))
    assert rec.idx.tolist() == [7, 19, 40] and len(rec) == 3 and rec.nbytes == 3 * 24
    idx = np.array([7, 8, 19, 40, 41])
    key = np.array([1, 1, 2, 4, 4], dtype=np.uint64)
    check = np.array([10, 10, 21, 40, 40], dtype=np.uint64)
    # 8 and 41 were never RAW; 19's content moved (its check differs): tried again.
    assert rec.same(idx, key, check).tolist() == [True, False, False, True, False]
    assert not RawRecord().same(idx, key, check).any()
    assert RawRecord.of(np.empty(0), np.empty(0), np.empty(0)).same(idx, key, check).tolist() == [False] * 5


def test_trims_after_a_compression_leave_its_raw_pages_alone_while_their_hash_holds() -> None:
    hist = CopyHistory.of_raw(np.array([3, 9]), np.array([30, 90], dtype=np.uint64), now=100.0)
    since, raw = hist.look_up(np.array([3, 5, 9]), np.array([30, 50, 91], dtype=np.uint64), now=105.0)
    assert raw.tolist() == [True, False, False]          # 9 was written since: no longer known RAW
    assert since.tolist() == [100.0, 105.0, 105.0]
