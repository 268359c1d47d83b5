"""The encoder's follow-up attempts are made where they pay (memory/attempts.py)."""

from __future__ import annotations

import numpy as np
import pytest

from azqemu.memory import attempts
from azqemu.memory.attempts import AttemptOdds
from azqemu.memory.store import PageStore
from azqemu.memory.zstdlib import ATTEMPT_SLOTS, ATTEMPTS

from .conftest import SMALL_ARENA, make_template, random_page

PLAIN_1K = ATTEMPTS.index("plain") * 4 + 1      # plain zstd after an XOR of 513-1024 bytes


def _stats(slot: int, tries: int, saved: int) -> np.ndarray:
    a = np.zeros(2 * ATTEMPT_SLOTS, dtype=np.uint64)
    a[2 * slot], a[2 * slot + 1] = tries, saved
    return a


def test_odds_follow_what_an_attempt_saves() -> None:
    odds = AttemptOdds()
    assert (odds.table() == 255).all()                         # nothing measured: every attempt
    odds.note(_stats(PLAIN_1K, attempts.WARMUP_TRIES - 1, 0))
    assert odds.table()[PLAIN_1K] == 255                        # not enough tries to judge
    odds.note(_stats(PLAIN_1K, 1, 0))
    table = odds.table()
    assert table[PLAIN_1K] == attempts.EXPLORE_ODDS             # saves nothing: rarely tried
    assert (np.delete(table, PLAIN_1K) == 255).all()            # the other slots are untouched
    # The data changes and the explored tries start to save: the counts halve past the half
    # life, so the new figure takes over.
    for _ in range(8):
        odds.note(_stats(PLAIN_1K, 4096, 4096 * 40))
    assert odds.table()[PLAIN_1K] == 255
    summary = odds.summary()
    assert summary["plain"][1] > attempts.SAVED_BYTES_MIN and summary["sdelta"] == [None] * 4


def test_an_attempt_that_never_pays_is_made_rarely_and_pages_stay_exact(store_dir) -> None:
    """Pages a few hundred scattered bytes from their template pages (a rewritten heap): the
    XOR is always smaller than plain zstd of the (random) page, so after its warm-up plain zstd
    is tried on about one page in 16; every page decodes exactly."""
    n = 2048
    tpl = [random_page(1000 + i) for i in range(n)]
    template = make_template(tpl)
    rng = np.random.default_rng(7)
    pages = np.stack(tpl)
    for p in pages:
        p[rng.choice(4096, 300, replace=False)] ^= 0x3C      # no PATCH (too many runs): XOR
    with PageStore(store_dir, arena_bytes=SMALL_ARENA) as store:
        if store.zstd.native is None:
            pytest.skip("_pagecodec.so not built")
        plain = xor = 0
        for s in range(0, n, 512):
            idx = np.arange(s, s + 512)
            r = store.encode("a", "d", idx, pages[idx], template, use_siblings=False)
            plain += r.tries["zstd"]
            xor += r.tries["xor"]
        assert xor == n
        warm = attempts.WARMUP_TRIES
        assert warm <= plain < warm + (n - warm) * 2 * attempts.EXPLORE_ODDS // 256 + 64, plain
        np.testing.assert_array_equal(store.decode("a", np.arange(n)), pages)
        store.check_consistency()
