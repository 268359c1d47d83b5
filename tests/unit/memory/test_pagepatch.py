"""PATCH payloads: exact round trips, the cap, malformed payloads refused, and the C encoder
choosing exactly what the Python reference chooses."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from azqemu.errors import StoreCorrupt
from azqemu.memory import pagepatch
from azqemu.memory.kinds import PAGE_SIZE, Kind, Method
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import PageZstd

from .conftest import SMALL_ARENA, text_page

edits_strategy = st.lists(st.tuples(st.integers(0, PAGE_SIZE - 1), st.integers(1, 40), st.integers(1, 255)),
                          min_size=0, max_size=12)


def _edited(ref: np.ndarray, edits: list[tuple[int, int, int]]) -> np.ndarray:
    """``ref`` with runs of bytes XORed by a non-zero value (so each edited byte changes)."""
    out = ref.copy()
    for at, n, v in edits:
        out[at:at + n] ^= v
    return out


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 1 << 16), edits=edits_strategy, zero_ref=st.booleans(), cap=st.integers(3, 300))
def test_round_trip_and_cap(seed: int, edits: list[tuple[int, int, int]], zero_ref: bool, cap: int) -> None:
    ref = np.zeros(PAGE_SIZE, np.uint8) if zero_ref else np.random.default_rng(seed).integers(0, 256, PAGE_SIZE,
                                                                                            dtype=np.uint8)
    page = _edited(ref, edits)
    xor = page ^ ref
    full = pagepatch.make_patch(page, xor, 1 << 20)
    capped = pagepatch.make_patch(page, xor, cap)
    if not xor.any():
        assert full is None and capped is None
        return
    # The cap only decides whether the patch is made, never what it is (a run longer than
    # its u8 length can say makes none at any cap).
    assert capped == (full if full is not None and len(full) <= cap else None)
    # Within the default cap a run's length fits its u8: patches up to the cap are exact.
    patch = pagepatch.make_patch(page, xor)
    if patch is not None:
        out = np.empty(PAGE_SIZE, np.uint8)
        pagepatch.apply_patch(patch, None if zero_ref else ref, out, "test")
        np.testing.assert_array_equal(out, page)
        # Runs start and end on changed bytes, and two runs are never closer than a gap the
        # encoder merges (a new run's header would cost more than the unchanged bytes).
        runs = _runs(patch)
        for (off, n), nxt in zip(runs, runs[1:] + [None]):
            assert xor[off] and xor[off + n - 1]
            if nxt is not None:
                assert nxt[0] - (off + n) > pagepatch.GAP_MERGE_BYTES


def _runs(patch: bytes) -> list[tuple[int, int]]:
    out, pos = [], 0
    while pos < len(patch):
        off, n = patch[pos] | patch[pos + 1] << 8, patch[pos + 2] + 1
        out.append((off, n))
        pos += 3 + n
    return out


@pytest.mark.parametrize("payload", [
    b"",                                   # empty
    b"\x00\x10",                           # header cut short
    b"\x00\x10\x04ab",                     # run cut short
    b"\xff\x0f\x01ab",                     # past the page's end (4095 + 2)
    b"\x10\x00\x00a\x08\x00\x00b",         # out of order
    b"\x10\x00\x01ab\x11\x00\x00c",        # overlapping
])
def test_malformed_patches_are_refused(payload: bytes) -> None:
    out = np.empty(PAGE_SIZE, np.uint8)
    with pytest.raises(StoreCorrupt):
        pagepatch.apply_patch(payload, None, out, "test")
    z = PageZstd()
    if z.native is not None:
        # The C bulk decode refuses the same payload (returns its index, 0).
        dst = np.empty((1, PAGE_SIZE), np.uint8)
        rc = z.decode_batch(payload or b"\x00", np.zeros(1, np.uint32), np.array([len(payload)], np.uint32),
                            np.array([int(Method.PATCH)], np.uint8), np.zeros(1, np.uint64), dst,
                            np.zeros(1, np.int64))
        assert rc == 0


def _template_and_edits(n: int, seed: int) -> tuple[TemplateImage, np.ndarray, np.ndarray]:
    """A template of text pages, and a sandbox whose pages are those pages with a few bytes
    changed (refcount-like: one to six bytes, here and there), some changed a lot."""
    rng = np.random.default_rng(seed)
    tpl = np.stack([text_page(seed * 1000 + i) for i in range(n)])
    template = TemplateImage(page_idx=np.arange(n, dtype=np.int64), pages=tpl, size_bytes=(n + 200) * PAGE_SIZE)
    pages = tpl.copy()
    for i in range(n):
        for _ in range(int(rng.integers(1, 6 if i % 4 else 60))):
            at = int(rng.integers(0, PAGE_SIZE - 8))
            pages[i, at:at + int(rng.integers(1, 7))] ^= 0x01
    return template, np.arange(n, dtype=np.int64), pages


def test_small_deltas_become_patches_and_decode_exactly(store_dir) -> None:
    template, idx, pages = _template_and_edits(64, seed=1)
    with PageStore(store_dir, arena_bytes=SMALL_ARENA, templates=(template,)) as store:
        res = store.encode("a", "d", idx, pages, template)
        assert res.pages["TDELTA"] == len(idx) and res.tries["patch"] >= len(idx)
        with store._lock:
            sb = store._sandboxes["a"]
            methods = store._table.rows["method"][sb.index.ref].tolist()
        assert methods.count(int(Method.PATCH)) >= len(idx) // 2
        np.testing.assert_array_equal(store.decode("a", idx), pages)
        buf = np.empty(PAGE_SIZE, np.uint8)
        for p in idx.tolist():
            store.decode_page_into("a", p, buf)
            np.testing.assert_array_equal(buf, pages[p])
        # A sibling with the same edits plus a few of its own: SDELTA patches or DUPs.
        sib = pages.copy()
        sib[:, 7] ^= 0x40
        store.encode("b", "d", idx + 100, sib, template, use_siblings=True)
        np.testing.assert_array_equal(store.decode("b", idx + 100), sib)
        store.check_consistency()


@pytest.mark.parametrize("hot", [False, True])
def test_native_and_python_choose_alike(store_dir, hot: bool) -> None:
    template, idx, pages = _template_and_edits(96, seed=2)
    out = []
    for native in (True, False):
        with PageStore(store_dir / f"n{native}{hot}", arena_bytes=SMALL_ARENA, templates=(template,)) as store:
            if store.zstd.native is None and native:
                pytest.skip("_pagecodec.so not built (make lib)")
            if not native:
                store.zstd.native = None
            r = store.encode("a", "d", idx, pages, template, hot=np.full(len(idx), hot))
            out.append((r.pages, r.bytes, r.tries["patch"]))
            assert (store.page_kinds("a", idx) == int(Kind.TDELTA)).all()
    assert out[0] == out[1]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(edits_strategy, min_size=8, max_size=8), seed=st.integers(0, 1 << 10))
def test_any_edits_round_trip_through_the_store(store_dir, edits, seed: int) -> None:
    tpl = np.stack([text_page(seed + i) for i in range(8)])
    template = TemplateImage(page_idx=np.arange(8, dtype=np.int64), pages=tpl, size_bytes=16 * PAGE_SIZE)
    pages = np.stack([_edited(tpl[i], e) for i, e in enumerate(edits)])
    idx = np.arange(8, dtype=np.int64)
    with PageStore(store_dir / str(seed), arena_bytes=SMALL_ARENA, templates=(template,)) as store:
        store.encode("a", "d", idx, pages, template)
        stored = store.stored_pages("a")
        np.testing.assert_array_equal(store.decode("a", stored), pages[stored])
