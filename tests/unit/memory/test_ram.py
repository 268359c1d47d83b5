"""RAM backings: layouts, data extents, reading resident pages without allocating holes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from azqemu.errors import ConfigError
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.ram import (
    GuestRamRange,
    RamLayout,
    data_extents,
    read_file_pages,
    read_resident_pages,
    resident_bytes,
    resident_page_index,
    write_sparse_image,
)

GIB = 1 << 30


def test_q35_small_ram_is_flat() -> None:
    lay = RamLayout.q35(512 << 20)
    assert len(lay.blocks) == 1
    assert int(lay.offset_to_gpa(0x1234000)) == 0x1234000


def test_q35_below_split_threshold_stays_below_4g() -> None:
    ram = 0xB0000000 - PAGE_SIZE          # just under 2.75 GiB: all below the hole
    lay = RamLayout.q35(ram)
    assert len(lay.blocks) == 1 and lay.blocks[0].size_bytes == ram


def test_q35_large_ram_splits_around_the_hole() -> None:
    lay = RamLayout.q35(4 * GIB)
    low, high = lay.blocks
    assert (low.offset, low.size_bytes, low.gpa) == (0, 0x80000000, 0)
    assert (high.offset, high.size_bytes, high.gpa) == (0x80000000, 2 * GIB, 4 * GIB)
    assert int(lay.offset_to_gpa(0x80000000)) == 4 * GIB
    assert int(lay.offset_to_gpa(0x7FFFF000)) == 0x7FFFF000
    assert int(lay.gpa_to_offset(4 * GIB + 0x5000)) == 0x80005000
    np.testing.assert_array_equal(lay.page_gpa(np.array([0, 0x80000])), [0, 4 * GIB])
    with pytest.raises(ConfigError):
        lay.gpa_to_offset(0x90000000)        # inside the PCI hole
    with pytest.raises(ConfigError):
        lay.offset_to_gpa(4 * GIB)           # past the end of the file


def test_overlapping_blocks_refused() -> None:
    with pytest.raises(ConfigError):
        RamLayout((GuestRamRange("a", 0, 8192, 0), GuestRamRange("b", 4096, 8192, 1 << 20)))
    with pytest.raises(ConfigError):
        GuestRamRange("c", 100, 4096, 0)


def _sparse(tmp_path, idx: list[int], n_pages: int = 64) -> tuple[str, np.ndarray]:
    rng = np.random.default_rng(1)
    pages = rng.integers(0, 256, (len(idx), PAGE_SIZE), dtype=np.uint8)
    path = str(tmp_path / "ram")
    write_sparse_image(path, np.array(idx), pages, n_pages * PAGE_SIZE)
    return path, pages


def test_extents_and_read(store_dir) -> None:
    path, pages = _sparse(store_dir, [0, 1, 2, 10, 40, 41, 63])
    fd = os.open(path, os.O_RDONLY)
    try:
        assert data_extents(fd) == [(0, 3 * PAGE_SIZE), (10 * PAGE_SIZE, PAGE_SIZE), (40 * PAGE_SIZE, 2 * PAGE_SIZE),
                                    (63 * PAGE_SIZE, PAGE_SIZE)]
    finally:
        os.close(fd)
    idx, got = read_resident_pages(path)
    np.testing.assert_array_equal(idx, [0, 1, 2, 10, 40, 41, 63])
    np.testing.assert_array_equal(got, pages)
    assert resident_bytes(path) == 7 * PAGE_SIZE


def test_reading_does_not_allocate_holes(store_dir) -> None:
    path, _ = _sparse(store_dir, [3, 30], n_pages=4096)
    blocks_before = os.stat(path).st_blocks
    read_resident_pages(path)
    assert os.stat(path).st_blocks == blocks_before


def test_read_through_proc_fd_of_a_memfd() -> None:
    fd = os.memfd_create("azq-test-ram")
    try:
        os.ftruncate(fd, 32 * PAGE_SIZE)
        os.pwrite(fd, b"\x07" * PAGE_SIZE, 5 * PAGE_SIZE)
        idx, pages = read_resident_pages(f"/proc/self/fd/{fd}")
        np.testing.assert_array_equal(idx, [5])
        assert (pages == 7).all()
        idx2, _ = read_resident_pages(fd)
        np.testing.assert_array_equal(idx2, [5])
    finally:
        os.close(fd)


def test_layout_clips_reads(store_dir) -> None:
    path, pages = _sparse(store_dir, [0, 5, 9])
    lay = RamLayout((GuestRamRange("low", 0, 4 * PAGE_SIZE, 0), GuestRamRange("high", 8 * PAGE_SIZE, 4 * PAGE_SIZE, 1 << 32)))
    idx, got = read_resident_pages(path, lay)
    np.testing.assert_array_equal(idx, [0, 9])
    np.testing.assert_array_equal(got, pages[[0, 2]])
    np.testing.assert_array_equal(lay.page_gpa(idx), [0, (1 << 32) + PAGE_SIZE])


def test_empty_file(store_dir) -> None:
    path = store_dir / "empty"
    path.write_bytes(b"")
    idx, pages = read_resident_pages(path)
    assert idx.shape == (0,) and pages.shape == (0, PAGE_SIZE)


def test_resident_pages_read_by_index_in_any_chunks() -> None:
    """resident_page_index + read_file_pages (what compress reads 8 MiB at a time) give the
    same pages as read_resident_pages, for any sorted subset; holes read as zeros."""
    fd = os.memfd_create("azq-test-ram")
    try:
        os.ftruncate(fd, 64 * PAGE_SIZE)
        for i in (1, 2, 3, 7, 30, 63):
            os.pwrite(fd, bytes([i]) * PAGE_SIZE, i * PAGE_SIZE)
        idx = resident_page_index(fd)
        all_idx, all_pages = read_resident_pages(fd)
        assert idx.tolist() == all_idx.tolist() == [1, 2, 3, 7, 30, 63]
        for rows in ([0, 1, 2, 3, 4, 5], [1, 2, 3], [0, 2, 5], [5]):
            assert np.array_equal(read_file_pages(fd, idx[rows]), all_pages[rows])
        assert not read_file_pages(fd, np.array([4, 5])).any()
    finally:
        os.close(fd)
