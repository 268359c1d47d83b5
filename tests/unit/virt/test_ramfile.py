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
