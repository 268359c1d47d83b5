"""The record of incompressible pages a compression left resident."""

from __future__ import annotations

import numpy as np

from azqemu.daemon.coldrule import CopyHistory
from azqemu.daemon.rawrecord import RawPass, RawRecord


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


def test_a_compression_tries_what_changed_or_what_the_store_holds_an_entry_for(tmp_path) -> None:
    """With a real store: of the pages recorded RAW with their content now, the ones the store
    holds nothing for are left untried; one a trim stored since (an entry) is tried again, and
    the record the pass leaves holds what came out RAW and what it left."""
    from azqemu.memory.pagehash import page_hashes
    from azqemu.memory.store import PageStore
    from tests.unit.memory.conftest import make_template, random_page, text_page

    template = make_template([text_page(i) for i in range(4)], n_pages=64)
    with PageStore(tmp_path / "store", arena_bytes=1 << 20) as store:
        idx = np.array([10, 11, 12, 13])
        pages = np.stack([random_page(1), random_page(2), random_page(3), text_page(9)])
        res = store.encode("s", "d", idx, pages, template)
        assert res.raw_idx.tolist() == [10, 11, 12]
        key, check = page_hashes(pages)
        record = RawRecord.of(idx[:3], key[:3], check[:3])
        # Page 12 since: a trim stored it (the store holds an entry for it now).
        store.encode("s", "d", idx[2:3], np.stack([text_page(12)]), template)
        pages[1] = random_page(7)                             # page 11 written since
        key, check = page_hashes(pages)
        rp = RawPass(record, store, "s", held=True)
        untried = rp.untried(idx, key, check, np.zeros(4, dtype=bool))
        assert untried.tolist() == [True, False, False, False] and rp.untried_pages == 1
        after = rp.after(np.array([11]))                      # the encode found 11 RAW again
        assert after.idx.tolist() == [10, 11] and (after.key == key[:2]).all()
        # A sandbox the store holds nothing for: every recorded page with its content is left.
        rp = RawPass(record, store, "other", held=False)
        assert rp.untried(idx, *page_hashes(np.stack([random_page(1), random_page(2), random_page(3),
                                                       text_page(9)])), np.zeros(4, dtype=bool)).tolist() \
            == [True, True, True, False]
