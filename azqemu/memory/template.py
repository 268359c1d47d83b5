"""Read-only access to a template's RAM image, its page hashes and its duplicate index.

The template RAM image is immutable once saved and is the common base of every clone. It is
read through a read-only shared mapping of the image file (the tmpfs working copy whose page
cache the clones map too), never copied into the manager's heap: the mapping costs the host
nothing beyond the page cache that already exists. A "row" is the page index itself: the
mapping covers the image's ``n_pages`` pages and one more page of untouched anonymous memory
(``zero_row`` = ``n_pages``) that reads as zeros without being allocated, so holes gather
from it. Holes and all-zero data pages have no row (``rows`` -1, ``slot_of`` -1) and are never
read through the mapping: reading a hole of a shared tmpfs mapping would allocate a page in the
file.

The hashes of the data pages are computed once here, in bounded chunks, and serve three
purposes: TEMPLATE verification on decode, DUP lookups of sandbox pages against the template
at any address, and the template's identity (``template_id``) which the store records so it
never decodes against a different template.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import xxhash

from azqemu.errors import StoreError
from azqemu.memory.kinds import PAGE_SHIFT, PAGE_SIZE
from azqemu.memory.pagehash import ZERO_CHECK, ZERO_KEY, page_hashes
from azqemu.memory.ram import RamLayout, _extent_pages, _page_extents
from azqemu.pages import unique_idx

# Pages hashed / fingerprinted per step: bounds every temporary whatever the template size.
INDEX_CHUNK_PAGES = 4096

_PROT_READ, _PROT_WRITE = 0x1, 0x2
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x01, 0x02, 0x10, 0x20, 0x4000
_MADV_DONTNEED = 4
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _fail(what: str) -> StoreError:
    return StoreError(f"template image: {what} failed: {os.strerror(ctypes.get_errno())}")


class _Mapping:
    """``rows`` pages of address space: anonymous (untouched: zeros, unallocated), the first
    ones replaceable by a shared read-only mapping of a file. Numpy arrays made from it keep
    it alive (it is their base); it is unmapped when the last of them goes."""

    def __init__(self, rows: int, *, writable: bool) -> None:
        self.rows = rows
        self.length = rows * PAGE_SIZE
        prot = _PROT_READ | (_PROT_WRITE if writable else 0)
        addr = _libc.mmap(None, self.length, prot, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr is None or addr == _MAP_FAILED:
            raise _fail("mmap")
        self.addr: int = int(addr)
        self.writable = writable

    def map_file(self, fd: int, length: int) -> None:
        """The file's first ``length`` bytes over the start of the range (shared, read-only)."""
        if length <= 0:
            return
        got = _libc.mmap(self.addr, length, _PROT_READ, _MAP_SHARED | _MAP_FIXED, fd, 0)
        if got != self.addr:
            raise _fail("mmap of the file")

    def drop_ptes(self, length: int) -> None:
        """Forget the page-table entries of the file part (the page cache stays; the next
        read maps the same page again): the manager's RSS then shows only what it uses."""
        if self.addr and length > 0:
            _libc.madvise(self.addr, length, _MADV_DONTNEED)

    @property
    def __array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.rows, PAGE_SIZE), "typestr": "|u1", "version": 3,
                "data": (self.addr, not self.writable)}

    def unmap(self) -> None:
        if self.addr:
            _libc.munmap(self.addr, self.length)
            self.addr = 0

    def __del__(self) -> None:
        self.unmap()


def _runs(idx: np.ndarray, chunk: int = INDEX_CHUNK_PAGES) -> Iterator[tuple[int, int]]:
    """(first page, count) of runs of consecutive pages in sorted ``idx``, at most ``chunk`` each."""
    if len(idx) == 0:
        return
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], cuts)).tolist()
    ends = np.concatenate((cuts, [len(idx)])).tolist()
    for s, e in zip(starts, ends):
        first = int(idx[s])
        for k in range(0, e - s, chunk):
            yield first + k, min(chunk, e - s - k)


class TemplateImage:
    """A template RAM file: pages by page index (holes read as zero), hashes, identity."""

    def __init__(self, path: str | os.PathLike[str] | None = None, layout: RamLayout | None = None, *,
                 page_idx: np.ndarray | None = None, pages: np.ndarray | None = None,
                 size_bytes: int | None = None) -> None:
        """Map ``path``; or build from arrays (``page_idx``, ``pages``, ``size_bytes``) for tests,
        in anonymous memory with the same layout."""
        self._lock = threading.Lock()
        self._simindex: object | None = None
        # (st_dev, st_ino) of the mapped file: the manager's cache checks it is the same file.
        self.file_id: tuple[int, int] | None = None
        if path is not None:
            self.path: str | None = os.fspath(path)
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as err:
                raise StoreError(f"cannot open template image {self.path}: {err.strerror}") from err
            try:
                st = os.fstat(fd)
                self.size_bytes = st.st_size
                self.file_id = (st.st_dev, st.st_ino)
                self.n_pages = (self.size_bytes + PAGE_SIZE - 1) >> PAGE_SHIFT
                idx = _extent_pages(_page_extents(fd, layout))
                mapping = _Mapping(self.n_pages + 1, writable=False)
                mapping.map_file(fd, self.n_pages * PAGE_SIZE)
            finally:
                os.close(fd)
        else:
            if page_idx is None or pages is None:
                raise ValueError("TemplateImage needs a path or page arrays")
            self.path = None
            idx = np.asarray(page_idx, dtype=np.int64)
            src = np.asarray(pages, dtype=np.uint8).reshape(len(idx), PAGE_SIZE)
            self.size_bytes = int(size_bytes if size_bytes is not None
                                  else ((int(idx.max()) + 1) << PAGE_SHIFT if len(idx) else 0))
            self.n_pages = (self.size_bytes + PAGE_SIZE - 1) >> PAGE_SHIFT
            if len(idx) and (idx.min() < 0 or idx.max() >= self.n_pages):
                raise ValueError("template page index outside the image")
            mapping = _Mapping(self.n_pages + 1, writable=True)
            dest = np.asarray(mapping)
            dest[idx] = src              # only these pages are ever written (allocated)
            del dest
            idx = unique_idx(idx)        # (writable underneath: tests corrupt a page on purpose)
        self._mapping: _Mapping | None = mapping
        pages_z = np.asarray(mapping)[:]       # a view: its base says whether it may be written
        pages_z.flags.writeable = False
        self.pages_z = pages_z
        self.pages_z_addr: int = mapping.addr    # for zstd prefixes on the fault path
        self.pages = pages_z[:self.n_pages]
        self.zero_row = self.n_pages
        self._index(idx)
        if self.path is not None:
            mapping.drop_ptes(self.n_pages * PAGE_SIZE)

    def _index(self, idx: np.ndarray) -> None:
        """Per-row hashes and the data pages, in chunks of consecutive pages (no full-size
        temporary). An all-zero data page counts as a hole: the image's identity and rows
        depend on its content only (a copy-on-write clone's read of a hole allocates a zero
        page in the template's tmpfs file; the image must not change identity because of it).
        """
        n = self.n_pages
        # Hashes are kept for the data pages only (aligned with ``page_idx``), and a page's
        # place among them in ``slot_of``: 4 bytes per page of the RAM file rather than the
        # 17 of dense per-page hashes (1.6 MiB less for a 512 MiB template, 13 for 4 GiB).
        pages, keys, checks = [], [], []
        for first, count in _runs(idx):
            view = self.pages_z[first:first + count]
            data = view.view(np.uint64).any(axis=1)
            if not data.any():
                continue
            k, c = page_hashes(view)
            pages.append(np.flatnonzero(data) + first)
            keys.append(k[data])
            checks.append(c[data])
        self.page_idx = np.concatenate(pages).astype(np.int64) if pages else np.zeros(0, np.int64)
        self._keys = np.concatenate(keys).astype(np.uint64) if keys else np.zeros(0, np.uint64)
        self._checks = np.concatenate(checks).astype(np.uint64) if checks else np.zeros(0, np.uint64)
        self.slot_of = np.full(n + 1, -1, dtype=np.int32)   # last slot: "outside"
        self.slot_of[self.page_idx] = np.arange(len(self.page_idx), dtype=np.int32)
        # Duplicate lookup: keys of the data pages, sorted, with their rows.
        order = np.argsort(self._keys, kind="stable")
        self._dup_keys = self._keys[order]
        self._dup_rows = self.page_idx[order].astype(np.int32)
        h = xxhash.xxh3_128()
        h.update(np.ascontiguousarray(self._checks).tobytes())
        h.update(self.page_idx.tobytes())
        h.update(self.size_bytes.to_bytes(8, "little"))
        self.template_id = h.hexdigest()

    # -- lookups ---------------------------------------------------------------------------
    def keys_of(self, page_idx: np.ndarray) -> np.ndarray:
        """Lookup key (XXH3-128's first half) of each page; holes and pages past the image
        have the zero page's."""
        slot = self.slot_of[np.minimum(np.maximum(np.asarray(page_idx, dtype=np.int64), 0), self.n_pages)]
        return np.where(slot >= 0, self._keys[np.maximum(slot, 0)] if len(self._keys) else ZERO_KEY,
                        ZERO_KEY).astype(np.uint64)

    def checks_of(self, page_idx: np.ndarray) -> np.ndarray:
        """Checksum (XXH3-128's second half) of each page, as hashed at load time; holes and
        pages past the image have the zero page's."""
        slot = self.slot_of[np.minimum(np.maximum(np.asarray(page_idx, dtype=np.int64), 0), self.n_pages)]
        return np.where(slot >= 0, self._checks[np.maximum(slot, 0)] if len(self._checks) else ZERO_CHECK,
                        ZERO_CHECK).astype(np.uint64)

    def check_of(self, page_idx: int) -> int:
        """``checks_of`` for one page (the fault path: no array built)."""
        slot = int(self.slot_of[page_idx]) if 0 <= page_idx < self.n_pages else -1
        return int(self._checks[slot]) if slot >= 0 else ZERO_CHECK

    @property
    def is_zero(self) -> np.ndarray:
        """Per page (and the "outside" slot): a hole or an all-zero page (built on each call)."""
        return self.slot_of < 0

    def rows(self, page_idx: np.ndarray) -> np.ndarray:
        """Template row of each page index, -1 for holes and indices past the image."""
        # A data page's row is its index (``pages`` maps the whole image); ``slot_of`` says
        # which pages have data: a dense row map beside it was 4 bytes a page for nothing.
        idx = np.minimum(np.maximum(np.asarray(page_idx, dtype=np.int64), 0), self.n_pages)
        return np.where(self.slot_of[idx] >= 0, idx, -1)

    def row(self, page_idx: int) -> int:
        """``rows`` of one page index."""
        return page_idx if 0 <= page_idx < self.n_pages and self.slot_of[page_idx] >= 0 else -1

    def rows_z(self, page_idx: np.ndarray) -> np.ndarray:
        """Rows into ``pages_z`` (holes -> the zero row)."""
        r = self.rows(page_idx)
        return np.where(r >= 0, r, self.zero_row)

    def gather(self, page_idx: np.ndarray) -> np.ndarray:
        """(n, 4096) copies of the template pages at these indices (zero for holes)."""
        return np.take(self.pages_z, self.rows_z(page_idx), axis=0)

    def page(self, page_idx: int) -> np.ndarray | None:
        """Read-only view of one template page, or None for a hole."""
        if page_idx < 0 or page_idx >= self.n_pages:
            return None
        return None if self.slot_of[page_idx] < 0 else self.pages[page_idx]

    def find_dups(self, key: np.ndarray) -> np.ndarray:
        """Template row with the same key for each key, -1 if none (caller confirms bytes)."""
        if len(self._dup_keys) == 0:
            return np.full(len(key), -1, dtype=np.int64)
        pos = np.searchsorted(self._dup_keys, key)
        pos_c = np.minimum(pos, len(self._dup_keys) - 1)
        hit = self._dup_keys[pos_c] == key
        return np.where(hit, self._dup_rows[pos_c], -1).astype(np.int64)

    def simindex(self) -> object:
        """The similarity index of the template's pages, built once (see simindex.py)."""
        with self._lock:
            if self._simindex is None:
                from azqemu.memory.simindex import N_SAMPLES, SimilarityIndex, sample_fingerprints
                fps = np.zeros((len(self.page_idx), N_SAMPLES), dtype=np.uint64)
                pos = 0
                for first, count in _runs(self.page_idx):
                    fps[pos:pos + count] = sample_fingerprints(self.pages_z[first:first + count])
                    pos += count
                # int32 sources (page indices): 16 bytes less per data page than int64.
                self._simindex = SimilarityIndex.build(fps, self.page_idx.astype(np.int32))
                if self.path is not None and self._mapping is not None:
                    self._mapping.drop_ptes(self.n_pages * PAGE_SIZE)
            return self._simindex

    def drop_mapped(self) -> None:
        """Let the manager's page tables forget the template pages it read (after a
        compression): they stay in the page cache, shared, and come back on the next read."""
        with self._lock:
            if self.path is not None and self._mapping is not None:
                self._mapping.drop_ptes(self.n_pages * PAGE_SIZE)

    @property
    def index_bytes(self) -> int:
        """Process memory of the image's index (hashes, rows, duplicate and similarity
        lookups), which the manager keeps while the template exists; the pages themselves are
        the shared mapping, not counted here."""
        arrays = (self._keys, self._checks, self.slot_of, self.page_idx, self._dup_keys, self._dup_rows)
        sim = self._simindex
        return int(sum(a.nbytes for a in arrays) + (getattr(sim, "nbytes", 0) if sim is not None else 0))

    @property
    def data_bytes(self) -> int:
        """Memory the template's data pages occupy (reported once, separately)."""
        return len(self.page_idx) * PAGE_SIZE

    @property
    def checks(self) -> np.ndarray:
        """u8 checksum of each data page, by slot (``slot_of``): the native lookup reads it."""
        return self._checks

    @property
    def closed(self) -> bool:
        return self._mapping is None

    def close(self) -> None:
        """Let the mapping go: it is unmapped now, or (if a page view of it is still in use
        somewhere) when the last such view goes; a closed image has no pages."""
        with self._lock:
            mapping, self._mapping = self._mapping, None
            if mapping is None:
                return
            empty = np.zeros((0, PAGE_SIZE), dtype=np.uint8)
            empty.flags.writeable = False
            self.pages_z = self.pages = empty
            self.pages_z_addr = 0
            self._simindex = None
        del mapping

    def __repr__(self) -> str:
        return f"TemplateImage({self.path!r}, {len(self.page_idx)} data pages, id {self.template_id[:12]})"
