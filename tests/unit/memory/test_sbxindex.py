"""The per-sandbox index: 2-bit map plus entries, lookups, persistence form."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.memory.kinds import FLAG_REF_TEMPLATE, Kind
from azqemu.memory.sbxindex import SandboxIndex

KINDS = [int(k) for k in (Kind.ZERO, Kind.TEMPLATE, Kind.DUP, Kind.TDELTA, Kind.SDELTA, Kind.ZSTD)]


@settings(max_examples=60, deadline=None)
@given(pages=st.dictionaries(st.integers(0, 5000), st.tuples(st.sampled_from(KINDS), st.integers(0, 1 << 31)),
                             max_size=200),
       probe=st.lists(st.integers(-5, 6000), max_size=50))
def test_index_round_trip(pages, probe) -> None:
    p = np.array(sorted(pages), dtype=np.int64)
    k = np.array([pages[i][0] for i in sorted(pages)], dtype=np.uint8)
    r = np.array([pages[i][1] if pages[i][0] not in KINDS[:2] else 0 for i in sorted(pages)], dtype=np.uint32)
    f = np.where((k == int(Kind.DUP)) & (r % 2 == 1), FLAG_REF_TEMPLATE, 0).astype(np.uint8)
    idx = SandboxIndex.from_pages(p[::-1], k[::-1], f[::-1], r[::-1])     # any input order
    assert idx.check() is None
    ep, ek, ef, er = idx.expand()
    np.testing.assert_array_equal(ep, p)
    np.testing.assert_array_equal(ek, k)
    np.testing.assert_array_equal(ef, f)
    np.testing.assert_array_equal(er, r)
    assert idx.n_pages == len(p)
    counts = idx.kind_page_counts()
    for kind in KINDS:
        assert counts[kind] == int((k == kind).sum())
    found, lk, lf, lr = idx.lookup(np.array(probe + p.tolist(), dtype=np.int64))
    for j, q in enumerate(probe + p.tolist()):
        one = idx.lookup_one(q) if q >= 0 else None
        if q in pages:
            assert found[j] and lk[j] == pages[q][0]
            assert one is not None and one[0] == pages[q][0]
            if pages[q][0] not in KINDS[:2]:
                assert lr[j] == pages[q][1] and one[2] == pages[q][1]
        else:
            assert not found[j] and one is None
    again = SandboxIndex.from_parts(bytes(idx.zt), idx.to_records())
    assert again.check() is None
    for a, b in zip(again.expand(), idx.expand()):
        np.testing.assert_array_equal(a, b)
    assert idx.nbytes == len(idx.zt) + 10 * idx.n_entries
    np.testing.assert_array_equal(np.sort(idx.blob_refs()), np.sort(r[(k >= int(Kind.DUP)) & (f == 0)]))


def test_map_is_compact() -> None:
    # 100,000 scattered zero/template pages over 400,000 slots cost 100 KB, not 9+ bytes each.
    rng = np.random.default_rng(0)
    p = rng.choice(400_000, 100_000, replace=False)
    k = rng.choice([int(Kind.ZERO), int(Kind.TEMPLATE)], len(p)).astype(np.uint8)
    idx = SandboxIndex.from_pages(p, k, np.zeros(len(p), np.uint8), np.zeros(len(p), np.uint32))
    assert idx.nbytes <= 100_000 and idx.n_entries == 0


def test_check_finds_damage() -> None:
    idx = SandboxIndex.from_pages(np.array([1, 2, 3]), np.array([int(Kind.ZERO), int(Kind.ZSTD), int(Kind.DUP)]),
                                  np.zeros(3, np.uint8), np.array([0, 5, 6], np.uint32))
    assert idx.check() is None
    idx.kind[0] = int(Kind.RAW)
    assert idx.check() == "bad entry kind"
    idx.kind[0] = int(Kind.ZSTD)
    idx.zt[0] |= 3 << 4          # page 2 in the map as well as an entry
    assert idx.check() is not None


_ROW = st.tuples(st.sampled_from(KINDS), st.integers(0, (1 << 32) - 1))


@settings(max_examples=80, deadline=None)
@given(before=st.dictionaries(st.integers(0, 3000), _ROW, max_size=150),
       remove=st.sets(st.integers(0, 3500), max_size=80),
       added=st.dictionaries(st.integers(0, 3500), _ROW, max_size=60))
def test_replacing_rows_equals_rebuilding_the_index(before, remove, added) -> None:
    """``replaced`` (a commit's incremental update) gives the index a full rebuild gives."""
    def rows(d: dict) -> tuple[np.ndarray, ...]:
        p = np.array(sorted(d), dtype=np.int64)
        k = np.array([d[i][0] for i in sorted(d)], dtype=np.uint8)
        r = np.array([d[i][1] if d[i][0] not in KINDS[:2] else 0 for i in sorted(d)], dtype=np.uint32)
        f = np.where((k == int(Kind.DUP)) & (r % 2 == 1), FLAG_REF_TEMPLATE, 0).astype(np.uint8)
        return p, k, f, r
    remove_all = np.array(sorted(remove | set(added)), dtype=np.int64)     # added rows replace theirs
    idx = SandboxIndex.from_pages(*rows(before))
    ap, ak, af, ar = rows(added)
    new, (gk, gf, gr) = idx.replaced(remove_all, ap[::-1], ak[::-1], af[::-1], ar[::-1])
    assert new.check() is None
    expect = {i: v for i, v in before.items() if i not in remove_all} | added
    for a, b in zip(new.expand(), SandboxIndex.from_pages(*rows(expect)).expand()):
        np.testing.assert_array_equal(a, b)
    gone = {i: v for i, v in before.items() if i in set(remove_all.tolist())}
    _, xk, xf, xr = rows(gone)
    np.testing.assert_array_equal(gk, xk)
    np.testing.assert_array_equal(gf, xf)
    np.testing.assert_array_equal(gr, xr)
    for q in list(expect)[:20]:
        assert new.lookup_one(q) is not None and new.lookup_one(q)[0] == expect[q][0]


def test_map_ends_at_its_highest_page_after_removals() -> None:
    # A copy-on-write clone's map empties at every map-back: an emptied map holds nothing
    # (it was 32 KiB of zeros for a 512 MiB sandbox), one that lost its top ends at the rest.
    p = np.array([5, 1000, 131_000], dtype=np.int64)
    k = np.array([int(Kind.ZERO), int(Kind.TEMPLATE), int(Kind.ZERO)], dtype=np.uint8)
    none = np.zeros(0, dtype=np.int64)
    idx, _ = SandboxIndex.empty().replaced(p, p, k, np.zeros(3, np.uint8), np.zeros(3, np.uint32))
    assert len(idx.zt) == 131_000 // 4 + 1
    top_gone, _ = idx.replaced(p[2:], none, none, none, none)
    assert len(top_gone.zt) == 1000 // 4 + 1 and top_gone.nbytes == len(top_gone.zt)
    assert top_gone.lookup_one(1000) == (int(Kind.TEMPLATE), 0, 0) and top_gone.lookup_one(131_000) is None
    emptied, (gk, _, _) = top_gone.replaced(p[:2], none, none, none, none)
    assert emptied.zt == bytearray() and emptied.nbytes == 0 and emptied.n_pages == 0 and len(gk) == 2
    assert SandboxIndex.from_parts(bytes(emptied.zt), emptied.to_records()).check() is None
