"""The template image read through a shared read-only mapping of its tmpfs file: the same
bytes as the file, holes never allocated, all-zero pages treated as holes, unmapped at close."""

from __future__ import annotations

import gc
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from azqemu.host.selfmem import self_memory
from azqemu.memory.kinds import PAGE_SIZE
from azqemu.memory.ram import write_sparse_image
from azqemu.memory.template import INDEX_CHUNK_PAGES, TemplateImage

from .conftest import text_page

N_PAGES = 64
DATA = [0, 1, 2, 5, 6, 7, 8, 20, 40, 63]
ZERO_DATA = 6            # written, but all zero: a hole for the template


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="azq-tpl-", dir=base) as d:
        yield Path(d)


def _image(path: Path) -> tuple[np.ndarray, np.ndarray]:
    pages = np.stack([np.zeros(PAGE_SIZE, np.uint8) if i == ZERO_DATA else text_page(100 + i) for i in DATA])
    idx = np.array(DATA, dtype=np.int64)
    write_sparse_image(path, idx, pages, N_PAGES * PAGE_SIZE)
    return idx, pages


def _mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        return any(int(line.split("-", 1)[0], 16) == addr for line in f)


def test_same_bytes_as_the_file_and_holes_stay_holes(shm_dir: Path) -> None:
    path = shm_dir / "ram.img"
    _image(path)
    blocks = os.stat(path).st_blocks
    t = TemplateImage(path)
    everything = np.arange(N_PAGES + 3, dtype=np.int64)         # past the end too
    got = t.gather(everything)
    t.simindex()
    for p in range(N_PAGES):
        assert t.page(p) is None or bytes(t.page(p)) == os.pread(os.open(path, os.O_RDONLY), PAGE_SIZE,
                                                                   p * PAGE_SIZE)
    with open(path, "rb") as f:
        want = np.frombuffer(f.read(), np.uint8).reshape(N_PAGES, PAGE_SIZE)
    np.testing.assert_array_equal(got[:N_PAGES], want)
    assert not got[N_PAGES:].any()
    # Not one hole of the tmpfs file was allocated by mapping, hashing, gathering or indexing.
    assert os.stat(path).st_blocks == blocks
    # Rows are page indices; holes and the all-zero data page have none.
    data = [p for p in DATA if p != ZERO_DATA]
    assert t.page_idx.tolist() == data
    assert t.rows(np.array([0, 3, ZERO_DATA, 63, 64])).tolist() == [0, -1, -1, 63, -1]
    assert [t.row(p) for p in (0, 3, ZERO_DATA, 63, 64, -1)] == [0, -1, -1, 63, -1, -1]
    assert t.zero_row == N_PAGES and not t.pages_z[t.zero_row].any()
    assert t.is_zero[ZERO_DATA] and t.is_zero[3] and not t.is_zero[5]
    assert t.find_dups(t.keys_of(np.array(data))).tolist() == data
    assert t.data_bytes == len(data) * PAGE_SIZE
    # The mapping is read-only: numpy refuses to write it (no segfault).
    with pytest.raises(ValueError):
        t.pages_z.flags.writeable = True


def test_file_and_arrays_give_the_same_template(shm_dir: Path) -> None:
    path = shm_dir / "ram.img"
    idx, pages = _image(path)
    mapped = TemplateImage(path)
    keep = idx != ZERO_DATA          # the zero page makes no difference to the identity
    built = TemplateImage(page_idx=idx[keep][::-1], pages=pages[keep][::-1], size_bytes=N_PAGES * PAGE_SIZE)
    assert built.template_id == mapped.template_id
    np.testing.assert_array_equal(built.gather(np.arange(N_PAGES)), mapped.gather(np.arange(N_PAGES)))
    every = np.arange(N_PAGES + 1)
    np.testing.assert_array_equal(built.keys_of(every), mapped.keys_of(every))
    np.testing.assert_array_equal(built.checks_of(every), mapped.checks_of(every))
    sb, sm = built.simindex(), mapped.simindex()
    np.testing.assert_array_equal(sb.keys, sm.keys)       # type: ignore[attr-defined]
    np.testing.assert_array_equal(sb.sources, sm.sources)  # type: ignore[attr-defined]


def test_runs_longer_than_a_chunk(shm_dir: Path) -> None:
    n = INDEX_CHUNK_PAGES + 100
    rng = np.random.default_rng(5)
    pages = rng.integers(0, 256, (n, PAGE_SIZE), dtype=np.uint8)
    path = shm_dir / "big.img"
    write_sparse_image(path, np.arange(1, n + 1), pages, (n + 8) * PAGE_SIZE)
    t = TemplateImage(path)
    assert t.page_idx.tolist() == list(range(1, n + 1))
    built = TemplateImage(page_idx=np.arange(1, n + 1), pages=pages, size_bytes=(n + 8) * PAGE_SIZE)
    assert built.template_id == t.template_id


def test_the_pages_are_not_copied_into_the_process(shm_dir: Path) -> None:
    n = 4096                                     # 16 MiB of data
    rng = np.random.default_rng(9)
    path = shm_dir / "ram.img"
    write_sparse_image(path, np.arange(n) * 2, rng.integers(0, 256, (n, PAGE_SIZE), dtype=np.uint8),
                       2 * n * PAGE_SIZE)
    gc.collect()
    before = self_memory()["anon_bytes"]
    t = TemplateImage(path)
    t.simindex()
    grew = self_memory()["anon_bytes"] - before
    assert grew < (n * PAGE_SIZE) // 4, grew      # per-page hashes and indexes only
    t.close()


def test_close_unmaps_once_no_view_is_left(shm_dir: Path) -> None:
    path = shm_dir / "ram.img"
    _image(path)
    t = TemplateImage(path)
    addr = t.pages_z_addr
    assert _mapped(addr)
    t.close()
    assert t.closed and not _mapped(addr) and len(t.pages_z) == 0
    t.close()                                    # twice is fine
    # A page view still in use keeps the mapping until it goes.
    t = TemplateImage(path)
    addr = t.pages_z_addr
    view = t.page(0)
    t.close()
    assert _mapped(addr) and view is not None and view.any()
    del view
    assert not _mapped(addr)
    # And an image nobody closed goes with its last reference.
    t = TemplateImage(path)
    addr = t.pages_z_addr
    del t
    gc.collect()
    assert not _mapped(addr)


def test_arrays_constructor_is_writable_underneath_for_tests() -> None:
    pages = np.stack([text_page(1), text_page(2)])
    t = TemplateImage(page_idx=np.array([3, 1]), pages=pages, size_bytes=8 * PAGE_SIZE)
    assert t.page_idx.tolist() == [1, 3] and t.rows(np.array([1, 3])).tolist() == [1, 3]
    assert bytes(t.page(3)) == pages[0].tobytes()      # type: ignore[arg-type]
    t.pages_z.flags.writeable = True
    t.pages_z[3, 0] ^= 1
    with pytest.raises(ValueError):
        TemplateImage(page_idx=np.array([9]), pages=pages[:1], size_bytes=8 * PAGE_SIZE)
