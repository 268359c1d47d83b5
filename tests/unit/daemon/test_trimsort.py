"""A trim's sort of copies: same, zero (at once, cold or not), cold, kept."""

from __future__ import annotations

import numpy as np

from azqemu.daemon.coldrule import CopyHistory
from azqemu.daemon.trimsort import TrimSort
from azqemu.memory.pagehash import page_hashes
from azqemu.pages import PAGE_SIZE


def _pages(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, PAGE_SIZE), dtype=np.uint8)


def test_zero_copies_go_at_once_cold_ones_after_the_cold_age_same_ones_without_encoding() -> None:
    idx = np.arange(100, 112, dtype=np.int64)
    pages = _pages(len(idx), 1)
    pages[[0, 5, 9]] = 0                  # freed by the guest (init_on_free)
    # Copies 1..4 were seen with these hashes 10 s ago (cold); 6 as well but faulted back
    # (in use); 7 is equal to its stored entry; 8 changed since; 10, 11 are new.
    key, check = page_hashes(pages)
    seen = np.array([1, 2, 3, 4, 6, 8])
    hist = CopyHistory()
    old_key = key[seen].copy()
    old_key[-1] ^= np.uint64(1)           # 8 moved
    hist.keep(idx[seen], old_key, np.full(len(seen), 90.0), np.zeros(len(seen), dtype=bool))
    sort = TrimSort(idx, 100.0, faulted=idx[[6, 9]], cold_after_s=4.0, prefetch_cold=True, history=hist,
                    entries_match=lambda part, k, c: np.isin(part, idx[[7]]))
    out = list(sort.sort(iter([(idx[:6], pages[:6]), (idx[6:], pages[6:])])))
    encoded = np.concatenate([p for p, _ in out])
    # The pages handed to the encoder are the rows named, in order.
    assert (np.concatenate([pg for _, pg in out]) == pages[np.searchsorted(idx, encoded)]).all()
    assert encoded.tolist() == sort.encoded.tolist() == idx[[0, 1, 2, 3, 4, 5, 9]].tolist()
    assert sort.zero.tolist() == idx[[0, 5, 9]].tolist()   # 9 was faulted back: zero goes anyway
    assert sort.same.tolist() == idx[[7]].tolist()
    sort.keep_history(idx[[0, 1, 7]])
    assert hist.idx.tolist() == np.setdiff1d(idx, idx[[0, 1, 7]]).tolist()
    assert hist.since[hist.idx == idx[2]][0] == 90.0 and hist.since[hist.idx == idx[8]][0] == 100.0


def test_a_recent_prefetch_keeps_same_copies_and_nothing_to_encode_yields_nothing() -> None:
    idx = np.arange(8, dtype=np.int64)
    pages = _pages(len(idx), 2)
    sort = TrimSort(idx, 5.0, faulted=np.empty(0, dtype=np.int64), cold_after_s=2.0, prefetch_cold=False,
                    history=CopyHistory(), entries_match=lambda part, k, c: np.ones(len(part), dtype=bool))
    assert list(sort.sort(iter([(idx, pages)]))) == []
    assert len(sort.same) == len(sort.encoded) == len(sort.zero) == 0
    assert (sort.key != 0).all()          # hashed: the next trim knows them
