"""Map-back's choice of untouched pages: only those in 2 MiB spans that have a page table."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from azqemu.restore.export import RamMapping
from azqemu.restore.mapback import PTE_SPAN_BYTES, untouched_in_page_tables

PS = 4096
SPAN_PAGES = PTE_SPAN_BYTES // PS


def _mapping(pages: int) -> tuple[mmap.mmap, int]:
    m = mmap.mmap(-1, pages * PS, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return m, ctypes.addressof(ctypes.c_char.from_buffer(m))


def _expected(hva: int, pages: int, touched: set[int], dropped: set[int]) -> list[int]:
    span = [(hva + i * PS) // PTE_SPAN_BYTES for i in range(pages)]
    live = {span[i] for i in touched | dropped}
    return [i for i in range(pages) if i not in touched and span[i] in live]


def test_only_spans_with_a_mapped_or_dropped_page_are_chosen() -> None:
    pages = 5 * SPAN_PAGES + 37                    # spans cut anywhere: the address decides
    m, hva = _mapping(pages)
    try:
        block = RamMapping(hva=hva, size_bytes=pages * PS, offset=0, page_size=PS, name="t", private=True)
        touched = {3, SPAN_PAGES + 100, SPAN_PAGES + 101, 4 * SPAN_PAGES}
        for i in touched:
            m[i * PS] = 1                          # a written page: present
        got = untouched_in_page_tables(os.getpid(), block, None)
        assert got.tolist() == _expected(hva, pages, touched, set())
        dropped = {2 * SPAN_PAGES + 7}
        got = untouched_in_page_tables(os.getpid(), block, np.array(sorted(dropped)))
        assert got.tolist() == _expected(hva, pages, touched, dropped)
        assert len(got) < pages - len(touched)     # the untouched spans are left alone
    finally:
        m.close()


def test_nothing_mapped_chooses_nothing() -> None:
    m, hva = _mapping(3 * SPAN_PAGES)
    try:
        block = RamMapping(hva=hva, size_bytes=3 * SPAN_PAGES * PS, offset=0, page_size=PS, name="t")
        assert len(untouched_in_page_tables(os.getpid(), block, None)) == 0
    finally:
        m.close()
