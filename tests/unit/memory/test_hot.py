"""Hot pages: encoded for decode speed (Kind.LZ4), decoded exactly, verified, in both loops."""

from __future__ import annotations

import numpy as np
import pytest

from azqemu.errors import ChecksumMismatch, StoreCorrupt, StoreError
from azqemu.memory import blobdecode, lz4page, zstdlib
from azqemu.memory.kinds import PAGE_SIZE, Kind, Method
from azqemu.memory.store import PageStore

from .conftest import text_page


def _methods(store: PageStore, sandbox: str, idx: np.ndarray) -> np.ndarray:
    """Blob method of each page (255 for pages without a blob of their own)."""
    out = np.full(len(idx), 255, dtype=np.uint8)
    for j, p in enumerate(idx.tolist()):
        hit = store._sandboxes[sandbox].index.lookup_one(p)
        if hit is not None and hit[0] in (int(Kind.TDELTA), int(Kind.SDELTA), int(Kind.ZSTD), int(Kind.LZ4)):
            out[j] = int(store._table.rows["method"][hit[2]])
    return out


def _pages(n: int, seed: int = 0) -> np.ndarray:
    return np.stack([text_page(seed + i) for i in range(n)])


def _empty_template(n_pages: int):
    from azqemu.memory.template import TemplateImage

    return TemplateImage(page_idx=np.zeros(0, np.int64), pages=np.zeros((0, PAGE_SIZE), np.uint8),
                         size_bytes=n_pages * PAGE_SIZE)


@pytest.mark.parametrize("native", [True, False])
def test_hot_pages_become_lz4_and_decode_exactly(store_dir, small_set, small_template, native: bool) -> None:
    idx, pages = small_set.sandboxes[0]
    hot = np.zeros(len(idx), dtype=bool)
    hot[::2] = True
    with PageStore(store_dir / "s") as store:
        if not native:
            store.zstd.native = None
        res = store.encode("a", "d", idx, pages, small_template, hot=hot)
        assert res.pages["LZ4"] > 0 and res.bytes["LZ4"] > 0 and res.tries["lz4"] >= res.pages["LZ4"]
        kinds = store.page_kinds("a", idx)
        # Codec pages that are hot decode with LZ4 (LZ4 kind, or deltas by LZ4_XOR) or are
        # patches (cheaper still); cold never LZ4.
        assert not (kinds[~hot] == int(Kind.LZ4)).any() and not (kinds[hot] == int(Kind.ZSTD)).any()
        methods = _methods(store, "a", idx)
        fresh = np.isin(kinds, (int(Kind.TDELTA), int(Kind.SDELTA), int(Kind.LZ4)))
        assert np.isin(methods[hot & fresh], (int(Method.LZ4), int(Method.LZ4_XOR), int(Method.PATCH))).all()
        assert not np.isin(methods[~hot & fresh], (int(Method.LZ4), int(Method.LZ4_XOR))).any()
        assert (methods[hot & fresh] == int(Method.LZ4_XOR)).any()      # some deltas survive
        assert (methods[hot & fresh] == int(Method.PATCH)).any() and (methods[~hot & fresh] == int(Method.PATCH)).any()
        stored = store.stored_pages("a")
        want = pages[np.searchsorted(idx, stored)]
        np.testing.assert_array_equal(store.decode("a", stored), want)
        buf = bytearray(PAGE_SIZE)
        for p in stored[kinds[np.searchsorted(idx, stored)] == int(Kind.LZ4)][:50].tolist():
            store.decode_page_into("a", p, memoryview(buf))
            assert bytes(buf) == pages[np.searchsorted(idx, p)].tobytes()
        store.check_consistency()


def test_native_and_python_choose_alike_for_hot_pages(store_dir, small_set, small_template) -> None:
    if not zstdlib.NATIVE_LZ4:
        pytest.skip("_pagecodec.so or liblz4 not available")
    idx, pages = small_set.sandboxes[1]
    hot = np.ones(len(idx), dtype=bool)
    out = []
    for native in (True, False):
        with PageStore(store_dir / f"n{native}") as store:
            if not native:
                store.zstd.native = None
            r = store.encode("a", "d", idx, pages, small_template, hot=hot)
            out.append((r.pages, r.bytes))
    assert out[0] == out[1]


def test_hot_flag_shape_checked(store, small_set, small_template) -> None:
    idx, pages = small_set.sandboxes[0]
    with pytest.raises(StoreError):
        store.encode("a", "d", idx, pages, small_template, hot=np.ones(len(idx) - 1, bool))


def test_hot_page_leaves_its_own_slow_blob(store_dir) -> None:
    """A page stored as ZSTD while cold, then hot: re-encoded as LZ4 and the old blob freed;
    a page identical to a sibling's blob keeps the shared blob (DUP)."""
    n = 64
    pages = _pages(n)
    idx = np.arange(n, dtype=np.int64)
    tpl = _empty_template(4 * n)
    with PageStore(store_dir / "s", templates=(tpl,)) as store:
        store.encode("a", "d", idx, pages, tpl)
        store.encode("b", "d", idx[:8] + n, pages[:8], tpl)      # shares 8 contents with a
        assert (store.page_kinds("a", idx) == int(Kind.ZSTD)).all()
        res = store.encode("a", "d", idx, pages, tpl, hot=np.ones(n, bool))
        kinds = store.page_kinds("a", idx)
        assert (kinds[:8] == int(Kind.DUP)).all() and (kinds[8:] == int(Kind.LZ4)).all()
        assert res.pages["LZ4"] == n - 8
        np.testing.assert_array_equal(store.decode("a", idx), pages)
        store.check_consistency()
        # The old ZSTD blobs of the 56 re-encoded pages are gone: 8 shared + 56 LZ4 remain.
        assert store.domain_bytes("d").payload_bytes == int(
            store._table.rows["length"][:store._table.n][store._table.rows["refcount"][:store._table.n] > 0].sum())
        live = store._table.rows[:store._table.n][store._table.rows["refcount"][:store._table.n] > 0]
        assert len(live) == 64


def test_split_bulk_decode_names_the_failing_page(store_dir, monkeypatch) -> None:
    """Bulk decodes split across two threads still verify every page and name the first bad one."""
    n = 700
    monkeypatch.setattr(blobdecode, "SPLIT_MIN_BLOBS", 100)
    pages = _pages(n, seed=50)
    idx = np.arange(n, dtype=np.int64) * 3
    tpl = _empty_template(3 * n)
    with PageStore(store_dir / "s", templates=(tpl,)) as store:
        hot = np.zeros(n, bool)
        hot[n // 3:] = True
        store.encode("a", "d", idx, pages, tpl, hot=hot)
        out = np.empty((n, PAGE_SIZE), np.uint8)
        store.decode_pages_into("a", idx, out.data)
        np.testing.assert_array_equal(out, pages)
        for victim_row in (5, n - 5):            # one in each half
            victim = int(idx[victim_row])
            hit = store._sandboxes["a"].index.lookup_one(victim)
            assert hit is not None
            store._table.rows["check"][hit[2]] ^= np.uint64(1)
            with pytest.raises(ChecksumMismatch) as err:
                store.decode("a", idx)
            assert err.value.page_idx == victim
            store._table.rows["check"][hit[2]] ^= np.uint64(1)
        np.testing.assert_array_equal(store.decode("a", idx), pages)


def test_damaged_lz4_payload_refused(store_dir) -> None:
    n = 16
    pages = _pages(n, seed=9)
    idx = np.arange(n, dtype=np.int64)
    tpl = _empty_template(n)
    with PageStore(store_dir / "s", templates=(tpl,)) as store:
        store.encode("a", "d", idx, pages, tpl, hot=np.ones(n, bool))
        hit = store._sandboxes["a"].index.lookup_one(3)
        assert hit is not None and hit[0] == int(Kind.LZ4)
        row = store._table.rows[hit[2]]
        arena = store._arenas.arenas[int(row["arena"])]
        for pos in (int(row["offset"]) + int(row["length"]) - 3, int(row["offset"])):
            arena.mm[pos] ^= 0x40
            with pytest.raises((ChecksumMismatch, StoreCorrupt)):
                store.decode("a", idx)
            buf = bytearray(b"\xee" * PAGE_SIZE)
            with pytest.raises((ChecksumMismatch, StoreCorrupt)):
                store.decode_page_into("a", 3, memoryview(buf))
            assert bytes(buf) == b"\xee" * PAGE_SIZE
            arena.mm[pos] ^= 0x40
        np.testing.assert_array_equal(store.decode("a", idx), pages)


def test_lz4_backends_read_each_other() -> None:
    import lz4.block

    page = text_page(77)
    out = np.empty(PAGE_SIZE, np.uint8)
    for level in (0, 2):
        lz4page.decompress_into(lz4.block.compress(page.tobytes(), store_size=False), out)
        assert np.array_equal(out, page)
        data = lz4.block.decompress(lz4page.compress(page, level), uncompressed_size=PAGE_SIZE)
        assert data == page.tobytes()


def test_native_checksum_is_the_store_checksum() -> None:
    if not zstdlib.NATIVE_CHECKS:
        pytest.skip("_pagecodec.so or libxxhash not available")
    from azqemu.memory.pagehash import page_checks

    pages = _pages(5, seed=3)
    got = np.zeros(5, np.uint64)
    rows = np.arange(5, dtype=np.int64)
    assert zstdlib._NATIVE is not None
    zstdlib._NATIVE.azq_page_checks(5, pages.ctypes.data, rows.ctypes.data, got.ctypes.data)
    np.testing.assert_array_equal(got, page_checks(pages))
