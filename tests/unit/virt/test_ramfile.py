"""Sparse RAM files: extents, sparse save, copy into a memfd."""

from __future__ import annotations

import os

import numpy as np

from azqemu.pages import data_extents
from azqemu.virt import ramfile

PAGE = 4096


def test_save_sparse_keeps_data_and_makes_zero_pages_holes(tmp_path) -> None:
    src = tmp_path / "src"
    pages = np.zeros((64, PAGE), dtype=np.uint8)
    pages[3, 10] = 1
    pages[40:44] = 7
    src.write_bytes(pages.tobytes())
    dst = tmp_path / "dst"
    written = ramfile.save_sparse(src, dst, 64 * PAGE)
    assert written == 5 * PAGE
    assert dst.read_bytes() == pages.tobytes()
    fd = os.open(dst, os.O_RDONLY)
    try:
        extents = list(data_extents(fd))
    finally:
        os.close(fd)
    assert sum(length for _, length in extents) < 64 * PAGE


def test_copy_into_memfd_round_trips(tmp_path) -> None:
    src = tmp_path / "src"
    rng = np.random.default_rng(1)
    data = rng.integers(0, 255, size=16 * PAGE, dtype=np.uint8).tobytes()
    with open(src, "wb") as f:
        f.truncate(64 * PAGE)
        f.seek(8 * PAGE)
        f.write(data)
    mfd = os.memfd_create("test-ram")
    try:
        os.ftruncate(mfd, 64 * PAGE)
        copied = ramfile.copy_into(src, f"/proc/self/fd/{mfd}")
        assert copied >= 16 * PAGE
        got = os.pread(mfd, 64 * PAGE, 0)
        assert got == src.read_bytes()
    finally:
        os.close(mfd)


def _allocated(path) -> int:
    return os.stat(path).st_blocks * 512


def test_zero_pages_a_private_mapping_made_the_file_hold_go_back(tmp_path) -> None:
    """On tmpfs a private mapping's first write to a hole allocates a zero page in the file
    (the copy is made from it); punch_zero_pages makes those holes again, and every byte read
    back is what it was."""
    import mmap
    import tempfile

    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="azq-test-ramfile-") as f:
        pages = np.zeros((256, PAGE), dtype=np.uint8)
        pages[5, 100] = 9
        pages[200:210] = 3
        src = tmp_path / "src"
        src.write_bytes(pages.tobytes())
        os.unlink(f.name)
        ramfile.save_sparse(src, f.name, 256 * PAGE)
        assert _allocated(f.name) == 11 * PAGE
        fd = os.open(f.name, os.O_RDONLY)
        try:
            with mmap.mmap(fd, 256 * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
                for p in range(20, 120):          # a clone's writes to holes
                    m[p * PAGE] = 1
                assert _allocated(f.name) == 111 * PAGE     # the file grew by the holes written
                assert ramfile.punch_zero_pages(f.name) == 100 * PAGE
                assert m[20 * PAGE] == 1                    # the clone's own copies stay its own
            assert _allocated(f.name) == 11 * PAGE
            with open(f.name, "rb") as back:
                assert back.read() == pages.tobytes()
            assert ramfile.punch_zero_pages(f.name) == 0    # nothing more to give back
        finally:
            os.close(fd)
