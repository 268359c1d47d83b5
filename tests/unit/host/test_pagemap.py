"""Finding and reading the pages a copy-on-write mapping wrote, from its pagemap."""

from __future__ import annotations

import mmap
import os
import re

import numpy as np
import pytest

from azqemu.host import pagemap
from azqemu.host.pagemap import (
    PAGE_IS_FILE,
    PAGE_IS_PRESENT,
    SCAN_REGIONS,
    anon_page_counts,
    private_pages,
    private_pages_read,
    read_pages,
    read_private_pages,
    scan_regions,
)
from azqemu.host.procfs import read_vma_smaps

PAGES = 64


@pytest.fixture
def cow_mapping(tmp_path):
    """A private mapping of a tmpfs file (as QEMU maps a template image), in this process."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"azq-cowscan-{os.getpid()}")
    with open(path, "wb") as f:
        f.write(bytes(range(256)) * (PAGES * 16))
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, PAGES * 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        yield m
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)


def _addr(m: mmap.mmap) -> int:
    import ctypes

    obj = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(obj)
    del obj
    return addr


def test_written_pages_are_found_and_read(cow_mapping) -> None:
    m = cow_mapping
    for i in range(PAGES):           # read every page: mapped from the file, not private
        assert m[i * 4096] == 0
    written = [3, 4, 5, 40]
    for i in written:
        m[i * 4096:(i + 1) * 4096] = bytes([i]) * 4096
    addr = _addr(m)
    idx = private_pages(os.getpid(), addr, PAGES)
    assert idx.tolist() == written
    idx2, pages = read_private_pages(os.getpid(), addr, PAGES)
    assert idx2.tolist() == written
    for row, i in enumerate(written):
        assert (pages[row] == i).all()


def test_read_pages_of_scattered_runs(cow_mapping) -> None:
    m = cow_mapping
    want = np.array([0, 1, 2, 10, 63])
    for i in want.tolist():
        m[i * 4096:(i + 1) * 4096] = bytes([7 + i]) * 4096
    pages = read_pages(os.getpid(), _addr(m), want)
    assert [int(p[0]) for p in pages] == [7 + i for i in want.tolist()]
    assert read_pages(os.getpid(), _addr(m), np.empty(0, dtype=np.int64)).shape == (0, 4096)


def _scan_and_read_agree(pid: int, addr: int, pages: int) -> np.ndarray:
    """private_pages (PAGEMAP_SCAN where the kernel has it) and the pagemap read give the
    same pages; returns them."""
    scanned = private_pages(pid, addr, pages)
    assert scanned.dtype == np.int64
    assert scanned.tolist() == private_pages_read(pid, addr, pages).tolist()
    return scanned


def test_the_scan_and_the_pagemap_read_find_the_same_copies(cow_mapping) -> None:
    m = cow_mapping
    addr = _addr(m)
    assert _scan_and_read_agree(os.getpid(), addr, PAGES).tolist() == []
    for i in range(0, PAGES, 3):     # file pages mapped, not copies
        assert m[i * 4096] == 0
    written = [1, 2, 3, 9, 30, 31, 63]
    for i in written:
        m[i * 4096] = 200
    assert _scan_and_read_agree(os.getpid(), addr, PAGES).tolist() == written
    # A sub-range: indices count from its first page.
    assert private_pages(os.getpid(), addr + 2 * 4096, 10).tolist() == [0, 1, 7]
    present, swapped = anon_page_counts(os.getpid(), addr, PAGES)
    assert (present, swapped) == (len(written), 0)


def test_the_zero_page_is_no_copy() -> None:
    """Pages of an anonymous mapping that were only read map the shared zero page: not copies
    (a copy-on-write clone's pages the manager mapped with UFFDIO_ZEROPAGE are the same)."""
    n = 32
    m = mmap.mmap(-1, n * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        addr = _addr(m)
        for i in range(n):
            assert m[i * 4096] == 0          # read faults: the zero page
        for i in (4, 5, 20):
            m[i * 4096] = 1
        assert _scan_and_read_agree(os.getpid(), addr, n).tolist() == [4, 5, 20]
        assert anon_page_counts(os.getpid(), addr, n) == (3, 0)
    finally:
        m.close()


def test_many_runs_are_walked_in_several_calls() -> None:
    """More runs than one PAGEMAP_SCAN call returns (every other page written): all found."""
    n = 2 * SCAN_REGIONS + 100
    m = mmap.mmap(-1, 2 * n * 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        for i in range(n):
            m[2 * i * 4096] = 1
        got = _scan_and_read_agree(os.getpid(), _addr(m), 2 * n)
        assert got.tolist() == list(range(0, 2 * n, 2))
    finally:
        m.close()


@pytest.mark.parametrize("scan", [True, False], ids=["ioctl", "pagemap-read"])
def test_the_counts_are_what_smaps_says_of_the_mapping(cow_mapping, monkeypatch: pytest.MonkeyPatch,
                                                      scan: bool) -> None:
    """The accounting reads anon_page_counts where it read smaps' Anonymous and Swap, with the
    ioctl and with the read of kernels without it."""
    monkeypatch.setattr(pagemap, "_scan_unsupported", not scan)
    m = cow_mapping
    for i in range(0, PAGES, 2):
        m[i * 4096] = 9
    addr = _addr(m)
    vma = read_vma_smaps(os.getpid(), addr, addr + PAGES * 4096)
    assert anon_page_counts(os.getpid(), addr, PAGES) == (vma["Anonymous"] // 4096, vma["Swap"] // 4096)


@pytest.mark.skipif(tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (6, 7),
                    reason="PAGEMAP_SCAN is in Linux 6.7 on")
def test_the_kernel_scan_is_used_where_the_kernel_has_it(cow_mapping) -> None:
    cow_mapping[0] = 1
    regions = scan_regions(os.getpid(), _addr(cow_mapping), PAGES, without=PAGE_IS_FILE,
                           anyof=PAGE_IS_PRESENT, report=PAGE_IS_PRESENT)
    assert regions is not None and regions.tolist() == [[0, 1, PAGE_IS_PRESENT]]


def test_an_empty_range_has_no_copies_and_keeps_the_scan(cow_mapping) -> None:
    assert private_pages(os.getpid(), _addr(cow_mapping), 0).tolist() == []
    cow_mapping[0] = 1
    assert _scan_and_read_agree(os.getpid(), _addr(cow_mapping), PAGES).tolist() == [0]
    assert scan_regions(os.getpid(), _addr(cow_mapping), PAGES, without=PAGE_IS_FILE,
                        anyof=PAGE_IS_PRESENT, report=PAGE_IS_PRESENT) is not None
