"""Finding and reading the pages a copy-on-write mapping wrote, from its pagemap."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from azqemu.host.pagemap import private_pages, read_pages, read_private_pages

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
