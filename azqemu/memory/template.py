"""Read-only access to a template's RAM image, its page hashes and its duplicate index.

The template RAM image is immutable once saved and is the common base of every clone. It is
read once through its data extents (holes are zero pages and are not allocated) and kept in
memory as a dense array of its data pages; the hashes of those pages are computed once here
and serve three purposes: TEMPLATE verification on decode, DUP lookups of sandbox pages
against the template at any address, and the template's identity (``template_id``) which the
store records so it never decodes against a different template.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import xxhash

from azqemu.errors import StoreError
from azqemu.memory.kinds import PAGE_SHIFT, PAGE_SIZE
from azqemu.memory.pagehash import page_hashes
from azqemu.memory.ram import RamLayout, read_resident_buffer


class TemplateImage:
    """A template RAM file: pages by page index (holes read as zero), hashes, identity."""

    def __init__(self, path: str | os.PathLike[str] | None = None, layout: RamLayout | None = None, *,
                 page_idx: np.ndarray | None = None, pages: np.ndarray | None = None,
                 size_bytes: int | None = None) -> None:
        """Open ``path``; or build from arrays (``page_idx``, ``pages``, ``size_bytes``) for tests."""
        if path is not None:
            self.path: str | None = os.fspath(path)
            try:
                self.size_bytes = os.stat(self.path).st_size
            except OSError as err:
                raise StoreError(f"cannot open template image {self.path}: {err.strerror}") from err
            idx, pages_z = read_resident_buffer(self.path, layout, spare_rows=1)
        else:
            if page_idx is None or pages is None:
                raise ValueError("TemplateImage needs a path or page arrays")
            self.path = None
            idx = np.asarray(page_idx, dtype=np.int64)
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
            pages_z = np.zeros((len(idx) + 1, PAGE_SIZE), dtype=np.uint8)
            pages_z[:len(idx)] = np.asarray(pages, dtype=np.uint8).reshape(len(idx), PAGE_SIZE)[order]
            self.size_bytes = int(size_bytes if size_bytes is not None
                                  else ((int(idx[-1]) + 1) << PAGE_SHIFT if len(idx) else 0))
        # An all-zero data page is a hole: the image's identity and rows depend on its
        # content only. (A copy-on-write clone's read of a hole allocates a zero page in
        # the template's tmpfs file; the image must not change identity because of it.)
        data = pages_z[:len(idx)].view(np.uint64).any(axis=1)
        if not data.all():
            keep = np.flatnonzero(data)
            idx = idx[keep]
            pages_z = np.concatenate([pages_z[keep], np.zeros((1, PAGE_SIZE), dtype=np.uint8)])
        self.n_pages = (self.size_bytes + PAGE_SIZE - 1) >> PAGE_SHIFT
        self.page_idx = idx
        # One trailing zero row: holes gather from it, so a single np.take serves any mix of
        # data pages and holes without temporaries.
        self.pages_z = pages_z
        self.pages_z.flags.writeable = False
        self.pages_z_addr: int = pages_z.ctypes.data    # for zstd prefixes on the fault path
        self.pages = self.pages_z[:len(idx)]
        self.zero_row = len(idx)
        pg = self.pages
        self.row_of = np.full(self.n_pages + 1, -1, dtype=np.int32)   # last slot: "outside"
        self.row_of[idx] = np.arange(len(idx), dtype=np.int32)
        self.key, self.check = page_hashes(pg)
        self.is_zero: np.ndarray = np.zeros(len(pg), dtype=bool)
        if len(pg):
            self.is_zero = np.logical_not(pg.view(np.uint64).any(axis=1))
        # Duplicate lookup: keys of the non-zero data pages, sorted.
        nz = np.flatnonzero(~self.is_zero)
        order = np.argsort(self.key[nz], kind="stable")
        self._dup_keys = self.key[nz][order]
        self._dup_rows = nz[order].astype(np.int32)
        self.template_id = xxhash.xxh3_128_hexdigest(
            np.ascontiguousarray(self.check).tobytes() + idx.tobytes() + self.size_bytes.to_bytes(8, "little"))
        self._lock = threading.Lock()
        self._simindex: object | None = None

    # -- lookups ---------------------------------------------------------------------------
    def rows(self, page_idx: np.ndarray) -> np.ndarray:
        """Template row of each page index, -1 for holes and indices past the image."""
        idx = np.asarray(page_idx, dtype=np.int64)
        return self.row_of[np.minimum(np.maximum(idx, 0), self.n_pages)]

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
        r = self.row_of[page_idx]
        return None if r < 0 else self.pages[r]

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
                from azqemu.memory.simindex import SimilarityIndex, sample_fingerprints
                fps = sample_fingerprints(self.pages)
                src = self.page_idx.astype(np.int64)
                self._simindex = SimilarityIndex.build(fps, src)
            return self._simindex

    @property
    def data_bytes(self) -> int:
        """Memory the template's data pages occupy (reported once, separately)."""
        return int(self.pages.nbytes)

    def __repr__(self) -> str:
        return f"TemplateImage({self.path!r}, {len(self.page_idx)} data pages, id {self.template_id[:12]})"
