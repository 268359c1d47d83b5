"""Pages: the unit every layer of azqemu counts in, and helpers on runs of them.

The ground level shared by the page codec (``memory``), the restore path (``restore``), the
VM layer's RAM files (``virt.ramfile``) and the host readers (``host``). ``page_idx`` counts
4 KiB pages from offset 0 of a RAM backing (``offset = page_idx * PAGE_SIZE``).
"""

from __future__ import annotations

import errno
import os

import numpy as np

PAGE_SIZE = 4096
PAGE_SHIFT = 12

# A compression's (or trim's) work buffers, by name, kept from one chunk to the next and
# dropped with the operation. A buffer of 256 KiB or more is an mmap of its own (the mmap
# threshold host/selfmem.py sets) whose pages fault in when first written: 2.8 us a page measured
# here, 1.45 ms for each fresh 2 MiB buffer, against 0.04 ms to refill a kept one. Fresh read,
# compaction and encoder buffers at every chunk cost ~1,700 such faults per 2 MiB of guest pages.
Scratch = dict[str, np.ndarray]


def scratch_rows(scratch: Scratch, name: str, rows: int) -> np.ndarray:
    """``rows`` page rows of the buffer ``name`` of ``scratch``, made (or grown) on demand;
    uninitialised: the caller writes them before reading."""
    buf = scratch.get(name)
    if buf is None or len(buf) < rows:
        buf = scratch[name] = np.empty((rows, PAGE_SIZE), dtype=np.uint8)
    return buf[:rows]


def take_rows(src: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``src[rows]`` (page rows) into ``out``. np.take's default mode ('raise') writes
    through a fresh temporary as large as ``out`` (numpy buffers ``out`` in that mode), which
    costs a 2 MiB allocation, faulted in, per chunk: mode 'clip' writes in place, and the
    bounds are checked here (one pass over the indices) so a bad row still raises."""
    rows = np.asarray(rows)
    if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= len(src)):
        raise IndexError(f"row index out of range 0..{len(src) - 1}")
    return np.take(src, rows, axis=0, out=out, mode="clip")


def in_sorted(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """``np.isin(values, sorted_set)`` for an ascending ``sorted_set``, by binary search. numpy's
    isin sorts both arrays at every call when the values span a guest's page range (its table
    method would allocate that range): 1 ms for a 512-page chunk against 3,000 faulted pages
    here, against 0.02 ms; a trim asked it for every chunk (30% of a trim's CPU)."""
    values = np.asarray(values)
    pos = np.searchsorted(sorted_set, values)
    hit = pos < len(sorted_set)
    hit[hit] = sorted_set[pos[hit]] == values[hit]
    return hit


def not_in_ids(values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``~np.isin(values, ids)`` for non-negative integer ids (blob ids), through a table of
    flags as long as the largest id: one pass, where isin sorts both arrays (a flush purged
    its 200,000 similarity entries of a few thousand freed ids in 3.0 ms, against 0.5)."""
    values, ids = np.asarray(values), np.asarray(ids)
    if not len(values) or not len(ids):
        return np.ones(len(values), dtype=bool)
    flags = np.zeros(max(int(values.max()), int(ids.max())) + 1, dtype=bool)
    flags[ids] = True
    return ~flags[values]


def unique_idx(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` of integers (ascending, each once) by a stable sort. numpy 2.3+
    hashes in np.unique: 6.0 ms for 40,000 page indices here against 1.3 ms for a sort, and
    a stable sort (timsort) merges the ascending runs these arrays are made of (sets joined,
    chunks concatenated) in linear time: the union of two sorted 20,000-page sets takes
    0.23 ms this way against np.union1d's 4.7 ms. And a plain np.unique (numpy 2.4) imports
    numpy.ma to ask whether its input is masked: 1.9 MiB the manager would hold for good."""
    a = np.sort(np.ravel(values), kind="stable")
    if len(a) < 2:
        return a
    first = np.empty(len(a), dtype=bool)
    first[0] = True
    np.not_equal(a[1:], a[:-1], out=first[1:])
    return a[first]


def unique_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``np.unique(values, return_counts=True)`` of integers, by a stable sort (unique_idx)."""
    a = np.sort(np.ravel(values), kind="stable")
    first = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1]))) if len(a) else np.empty(0, np.int64)
    return a[first], np.diff(np.append(first, len(a)))


def union_idx(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.union1d(a, b)`` of integers (unique_idx)."""
    return unique_idx(np.concatenate((np.ravel(a), np.ravel(b))))


def setdiff_idx(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.setdiff1d(a, b)`` of integers: the values of ``a`` not in ``b``, ascending, once."""
    u = unique_idx(a)
    return u[~in_sorted(u, unique_idx(b))]


def intersect_idx(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``np.intersect1d(a, b)`` of integers: the values in both, ascending, once."""
    u = unique_idx(a)
    return u[in_sorted(u, unique_idx(b))]


def page_runs(page_idxs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique page indices -> (run starts, run lengths)."""
    if len(page_idxs) == 0:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    cuts = np.flatnonzero(np.diff(page_idxs) != 1) + 1
    starts_at = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts_at, [len(page_idxs)])))
    return page_idxs[starts_at], lengths


def data_extents(fd: int) -> list[tuple[int, int]]:
    """Data extents of a file as page-aligned (offset, length), walked with SEEK_DATA/SEEK_HOLE.

    Relies on lseek(2) SEEK_DATA/SEEK_HOLE (Linux >= 3.1; tmpfs, memfd, ext4, xfs report real
    holes; a filesystem without support reports one extent covering the whole file, which is
    correct, only slower).
    """
    size = os.fstat(fd).st_size
    extents: list[tuple[int, int]] = []
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as err:
            if err.errno == errno.ENXIO:      # no data after pos
                break
            raise
        end = os.lseek(fd, start, os.SEEK_HOLE)
        # Round outwards to whole pages: extents on tmpfs are page granular anyway.
        a = start & ~(PAGE_SIZE - 1)
        b = min((end + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1), (size + PAGE_SIZE - 1) & ~(PAGE_SIZE - 1))
        if extents and extents[-1][0] + extents[-1][1] >= a:
            prev_a = extents[-1][0]
            extents[-1] = (prev_a, max(b, prev_a + extents[-1][1]) - prev_a)
        else:
            extents.append((a, b - a))
        pos = end
    return extents
