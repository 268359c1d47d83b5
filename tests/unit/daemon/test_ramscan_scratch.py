"""A compression's scratch buffers (ramscan.Scratch): reused from chunk to chunk, they change
no result. The same pages encoded through one scratch or through fresh buffers give the same
entries; copy-on-write reads land in the scratch; dropping rows keeps the rest in order."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from azqemu.daemon.ramscan import CHUNK_PAGES, RamScan, without_rows
from azqemu.host.pagemap import read_pages
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.pages import PAGE_SIZE, Scratch, scratch_rows

N_PAGES = 3 * CHUNK_PAGES + 17


def _guest(rng: np.random.Generator, template: np.ndarray) -> np.ndarray:
    """Pages of five kinds: template copies, edited template pages, zero, text, random."""
    pages = np.empty((N_PAGES, PAGE_SIZE), dtype=np.uint8)
    for p in range(N_PAGES):
        k = p % 5
        if k == 0:
            pages[p] = template[p % len(template)]
        elif k == 1:
            pages[p] = template[(p * 7) % len(template)]
            pages[p, p % 4000:p % 4000 + 24] = p & 0xFF
        elif k == 2:
            pages[p] = 0
        elif k == 3:
            pages[p] = rng.integers(97, 105, PAGE_SIZE, dtype=np.uint8)
        else:
            pages[p] = rng.integers(0, 256, PAGE_SIZE, dtype=np.uint8)
    return pages


def _entries(store: PageStore, sandbox: str) -> list[tuple[int, bytes]]:
    """Every stored page of ``sandbox`` decoded: (page, content)."""
    idx = store.stored_pages(sandbox)
    out = np.empty(PAGE_SIZE, dtype=np.uint8)
    got = []
    for p in idx.tolist():
        store.decode_page_into(sandbox, p, out)
        got.append((p, out.tobytes()))
    return got


def test_a_shared_scratch_encodes_as_fresh_buffers_do(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tpl_pages = rng.integers(97, 110, (CHUNK_PAGES, PAGE_SIZE), dtype=np.uint8)
    template = TemplateImage(page_idx=np.arange(CHUNK_PAGES, dtype=np.int64), pages=tpl_pages,
                             size_bytes=N_PAGES * PAGE_SIZE)
    guest = _guest(rng, tpl_pages)
    try:
        results = []
        for name, scratch in (("fresh", None), ("shared", Scratch())):
            store = PageStore(tmp_path / name)
            stored = []
            for s in range(0, N_PAGES, CHUNK_PAGES):
                part = np.arange(s, min(N_PAGES, s + CHUNK_PAGES), dtype=np.int64)
                # The chunk is copied into a reused buffer, as RamScan.chunks does with a scratch.
                pages = guest[part] if scratch is None else scratch_rows(scratch, "read", len(part))
                if scratch is not None:
                    pages[:] = guest[part]
                res = store.encode("s", "d", part, pages, template, scratch=scratch)
                stored.append(res.stored_idx)
            store.flush()
            results.append(_entries(store, "s"))
            assert {p: c for p, c in results[-1]} == {p: guest[p].tobytes() for p, _ in results[-1]}
            store.close()
        assert results[0] == results[1] and len(results[0]) > N_PAGES // 2
    finally:
        template.close()


def test_copy_on_write_reads_land_in_the_scratch() -> None:
    m = mmap.mmap(-1, 8 * PAGE_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = ctypes.c_char.from_buffer(m)
    try:
        for p in range(8):
            m[p * PAGE_SIZE:(p + 1) * PAGE_SIZE] = bytes([p + 1]) * PAGE_SIZE
        scan = RamScan(os.getpid(), ctypes.addressof(buf), 8, -1, True)
        scratch = Scratch()
        idx = np.array([1, 2, 5], dtype=np.int64)
        (part, pages), = list(scan.chunks(idx, scratch))
        assert pages.base is scratch["read"] or np.shares_memory(pages, scratch["read"])
        assert [int(r[0]) for r in pages] == [2, 3, 6] and part.tolist() == [1, 2, 5]
        other = read_pages(os.getpid(), ctypes.addressof(buf), idx)       # no out: a new array
        assert not np.shares_memory(other, scratch["read"]) and np.array_equal(other, pages)
    finally:
        del buf
        m.close()


@pytest.mark.parametrize("native", [True, False])
def test_without_rows_keeps_the_rest_in_order(native: bool, monkeypatch) -> None:
    """Without scratch: new arrays. With it: in place in the chunk's own buffer (C), or in the
    scratch buffer "kept" where _pagecodec.so is not built."""
    from azqemu.memory import zstdlib

    if native and not zstdlib.native_available():
        pytest.skip("_pagecodec.so not built")
    if not native:
        monkeypatch.setattr(zstdlib, "_NATIVE", None)
    part = np.arange(10, dtype=np.int64)
    pages = np.repeat(np.arange(10, dtype=np.uint8)[:, None], PAGE_SIZE, axis=1)
    drop = part % 3 == 0
    scratch = Scratch()
    for s in (None, scratch):
        kept_part, kept_pages = without_rows(part, pages, drop, s)
        assert kept_part.tolist() == [1, 2, 4, 5, 7, 8]
        assert [int(r[0]) for r in kept_pages] == [1, 2, 4, 5, 7, 8]
        assert np.all(kept_pages == kept_pages[:, :1])           # whole rows moved
    assert np.shares_memory(kept_pages, pages) == native
    assert ("kept" in scratch) != native
    assert len(without_rows(part, pages, np.ones(10, dtype=bool), scratch)[1]) == 0
