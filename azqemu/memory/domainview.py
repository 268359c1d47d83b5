"""The encoder's window on one sharing domain of the page store (encoder.DomainView).

An encode plans outside the store's state lock; what it needs to know about the blobs already
in the sandbox's domain (DUP targets, SDELTA bases, their content and decode cost, whether
another holder shares them) it asks through this view, which takes the store's lock for the
lookups that read the domain's indices or copy a payload out, and decodes outside it. What the
view returns may be stale by the time the plan is committed: PageStore re-checks at commit that
every blob the plan references is still live (store.py's module docstring).
"""

from __future__ import annotations

import threading

import numpy as np

from azqemu.memory.arena import ArenaSet
from azqemu.memory.blobdecode import decode_batch, read_batch
from azqemu.memory.blobtable import BlobTable, DomainState
from azqemu.memory.kinds import DECODE_COST_US, PAGE_SIZE, Method, RefType
from azqemu.memory.simindex import LayeredIndex, SimilarityIndex
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import PageZstd
from azqemu.pages import unique_idx

_REFTYPE_BLOB = int(RefType.BLOB)
_COST_US_OF_METHOD = np.array([DECODE_COST_US[Method(m)] for m in range(max(Method) + 1)])
# Blobs decoded for the encoder (DUP confirmation, SDELTA bases) are cached per encode call.
ENCODER_BLOB_CACHE_PAGES = 4096


class StoreDomainView:
    """The encoder's window on domain ``d`` of a store (its state lock, table, arenas, codec)."""

    def __init__(self, lock: threading.RLock, table: BlobTable, arenas: ArenaSet, zstd: PageZstd,
                 d: DomainState, template: TemplateImage, own_refs: np.ndarray | None = None) -> None:
        self.lock, self.table, self.arenas, self.zstd = lock, table, arenas, zstd
        self.d, self.template = d, template
        self.cache: dict[int, np.ndarray] = {}
        # Blob ids the encoding sandbox references now (sorted): its old entries.
        self.own_refs = unique_idx(own_refs) if own_refs is not None else np.zeros(0, np.uint32)

    def find_dups(self, key: np.ndarray) -> np.ndarray:
        with self.lock:
            return self.table.find_dups(self.d, key)

    def blob_pages(self, blob_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The contents of many blobs the plan found, as page rows in the order asked, and
        whether each still lives (False: freed since the plan found it: a sibling's discard or
        free runs beside the encode). One take of the store's lock and one decode (C, verified)
        for the blobs not cached, where a lookup per page took the lock and decoded in Python:
        a take of the lock costs the compression worker two priority changes (the raise a
        holder gets, nativestore.NativeLock)."""
        ids = np.asarray(blob_ids, dtype=np.int64)
        out = np.empty((len(ids), PAGE_SIZE), dtype=np.uint8)
        ok = np.zeros(len(ids), dtype=bool)
        missing: list[int] = []
        for i, b in enumerate(ids.tolist()):
            page = self.cache.get(b)
            if page is None:
                missing.append(i)
            else:
                out[i], ok[i] = page, True
        if not missing:
            return out, ok
        want = np.asarray(missing, dtype=np.int64)
        uniq, inv = np.unique(ids[want], return_inverse=True)
        with self.lock:
            live = self._live(uniq)
            batch = read_batch(self.table, self.arenas, uniq[live]) if live.any() else None
        if batch is None:
            return out, ok
        pages = decode_batch(self.zstd, batch, self.template)
        row_of = np.cumsum(live) - 1            # uniq position -> row of pages (where live)
        got = live[inv]
        out[want[got]] = pages[row_of[inv[got]]]
        ok[want[got]] = True
        if len(self.cache) + len(pages) > ENCODER_BLOB_CACHE_PAGES:
            self.cache.clear()
        self.cache.update(zip(uniq[live].tolist(), pages))
        return out, ok

    def _live(self, ids: np.ndarray) -> np.ndarray:
        """Under the lock: whether each blob (and its SDELTA base) is still referenced."""
        n, rows = self.table.n, self.table.rows
        live = (ids >= 0) & (ids < n)
        r = rows[ids[live]]
        base = r["ref"].astype(np.int64)
        based = r["reftype"] == _REFTYPE_BLOB
        base_ok = (base >= 0) & (base < n)
        base_ok[base_ok] = rows["refcount"][base[base_ok]] > 0
        live[live] = (r["refcount"] > 0) & (~based | base_ok)
        return live

    def blob_decode_cost_us(self, blob_id: int) -> float:
        return float(_COST_US_OF_METHOD[int(self.table.rows["method"][blob_id])])

    def blob_shared(self, blob_id: int) -> bool:
        """Whether anything but one old entry of the encoding sandbox holds the blob."""
        if int(self.table.rows["refcount"][blob_id]) > 1:
            return True
        i = int(np.searchsorted(self.own_refs, blob_id))
        return not (i < len(self.own_refs) and int(self.own_refs[i]) == blob_id)

    def bases_among(self, blob_ids: np.ndarray) -> np.ndarray:
        """Per blob: whether it may serve as an SDELTA base (live, of this domain, not itself
        based on a blob). Read without the lock: the commit checks again."""
        ids = np.asarray(blob_ids, dtype=np.int64)
        ok = (ids >= 0) & (ids < self.table.n)
        r = self.table.rows[ids[ok]]
        ok[ok] = (r["refcount"] > 0) & (r["domain"] == self.d.did) & (r["reftype"] != _REFTYPE_BLOB)
        return ok

    def decode_costs_us(self, blob_ids: np.ndarray) -> np.ndarray:
        """``blob_decode_cost_us`` of many blobs."""
        return _COST_US_OF_METHOD[self.table.rows["method"][np.asarray(blob_ids, dtype=np.int64)]]

    def sim_index(self) -> SimilarityIndex | LayeredIndex:
        with self.lock:
            return self.table.sim_index(self.d)
