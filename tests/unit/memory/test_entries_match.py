"""PageStore.entries_match: which resident pages still equal their stored entries (no VM).

A page that matches keeps its entry (not encoded again) and may be dropped again while the
sandbox runs; so a match must mean "decodes to these exact bytes", and anything unsure is
"does not match"."""

from __future__ import annotations

import numpy as np

from azqemu.memory.kinds import PAGE_SIZE, Kind
from azqemu.memory.pagehash import page_hashes


def test_unchanged_pages_match_and_decode_to_the_same_bytes(store, small_set, small_template) -> None:
    page_idx, pages = small_set.sandboxes[0]
    res = store.encode("s0", "d", page_idx, pages, small_template)
    key, check = page_hashes(pages)
    same = store.entries_match("s0", page_idx, key, check)
    kinds = store.page_kinds("s0", page_idx)
    blob_kinds = np.isin(kinds, [Kind.DUP, Kind.TDELTA, Kind.SDELTA, Kind.ZSTD, Kind.LZ4])
    assert same.any() and not same[~blob_kinds].any()
    assert np.isin(page_idx[same], res.stored_idx).all()
    # Every matching page decodes to exactly the page that was hashed.
    out = store.decode("s0", page_idx[same])
    assert (out == pages[same]).all()


def test_a_changed_byte_never_matches(store, small_set, small_template) -> None:
    page_idx, pages = small_set.sandboxes[1]
    store.encode("s1", "d", page_idx, pages, small_template)
    changed = pages.copy()
    changed[:, 4095] ^= 1                                   # one bit in every page
    key, check = page_hashes(changed)
    assert not store.entries_match("s1", page_idx, key, check).any()


def test_other_sandboxes_and_unknown_pages_never_match(store, small_set, small_template) -> None:
    (a_idx, a_pages), (b_idx, b_pages) = small_set.sandboxes[0], small_set.sandboxes[1]
    store.encode("a", "d", a_idx, a_pages, small_template)
    key, check = page_hashes(a_pages)
    assert store.entries_match("a", a_idx, key, check).any()
    assert not store.entries_match("b", a_idx, key, check).any()          # no entries
    store.encode("b", "d", b_idx[:10], b_pages[:10], small_template)
    far = a_idx + 10 ** 6                                                  # no entry there
    assert not store.entries_match("a", far, key, check).any()
    store.discard("a", a_idx)
    assert not store.entries_match("a", a_idx, key, check).any()           # released


def test_page_hashes_are_xxh3_128_halves_on_every_path(monkeypatch) -> None:
    """The C loop (where _pagecodec.so is built) and the per-page xxhash calls give the same
    (key, check): the canonical XXH3-128 digest's two halves, read little-endian."""
    import xxhash

    from azqemu.memory import pagehash

    rng = np.random.default_rng(5)
    pages = rng.integers(0, 256, (64, PAGE_SIZE), dtype=np.uint8)
    pages[::4] = 0
    want = np.frombuffer(b"".join(xxhash.xxh3_128_digest(p.data) for p in pages), "<u8").reshape(-1, 2)
    rows = np.array([9, 0, 63, 9], dtype=np.int64)
    for native in (True, False):
        if not native:
            monkeypatch.setattr(pagehash, "_native", lambda: None)
        key, check = pagehash.page_hashes(pages)
        assert (key == want[:, 0]).all() and (check == want[:, 1]).all(), native
        k2, c2 = pagehash.page_hashes_rows(pages, rows)
        assert (k2 == want[rows, 0]).all() and (c2 == want[rows, 1]).all(), native
