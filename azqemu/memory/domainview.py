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
from azqemu.memory.blobdecode import decode_recipe, read_recipe
from azqemu.memory.blobtable import BlobTable, DomainState
from azqemu.memory.kinds import DECODE_COST_US, PAGE_SIZE, Method, RefType
from azqemu.memory.simindex import LayeredIndex, SimilarityIndex
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import PageZstd

_REFTYPE_BLOB = int(RefType.BLOB)
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
        self.own_refs = np.unique(own_refs) if own_refs is not None else np.zeros(0, np.uint32)

    def find_dups(self, key: np.ndarray) -> np.ndarray:
        with self.lock:
            return self.table.find_dups(self.d, key)

    def blob_page(self, blob_id: int) -> np.ndarray | None:
        """The content of a blob the plan found, or None if it was freed since (a sibling's
        discard or free runs beside the encode: the candidate is gone, not the store damaged;
        the commit re-checks what the plan keeps)."""
        page = self.cache.get(blob_id)
        if page is None:
            page = np.empty(PAGE_SIZE, dtype=np.uint8)
            with self.lock:
                if not (0 <= blob_id < self.table.n and int(self.table.rows["refcount"][blob_id]) > 0):
                    return None
                base = int(self.table.rows["ref"][blob_id])
                if (int(self.table.rows["reftype"][blob_id]) == _REFTYPE_BLOB
                        and not (0 <= base < self.table.n and int(self.table.rows["refcount"][base]) > 0)):
                    return None
                recipe = read_recipe(self.table, self.arenas, blob_id)
            decode_recipe(self.zstd, recipe, page, self.template)
            if len(self.cache) >= ENCODER_BLOB_CACHE_PAGES:
                self.cache.clear()
            self.cache[blob_id] = page
        return page

    def blob_decode_cost_us(self, blob_id: int) -> float:
        return DECODE_COST_US[Method(int(self.table.rows["method"][blob_id]))]

    def blob_shared(self, blob_id: int) -> bool:
        """Whether anything but one old entry of the encoding sandbox holds the blob."""
        if int(self.table.rows["refcount"][blob_id]) > 1:
            return True
        i = int(np.searchsorted(self.own_refs, blob_id))
        return not (i < len(self.own_refs) and int(self.own_refs[i]) == blob_id)

    def blob_is_base(self, blob_id: int) -> bool:
        rows = self.table.rows
        return (blob_id < self.table.n and int(rows["refcount"][blob_id]) > 0
                and int(rows["domain"][blob_id]) == self.d.did and int(rows["reftype"][blob_id]) != _REFTYPE_BLOB)

    def sim_index(self) -> SimilarityIndex | LayeredIndex:
        with self.lock:
            return self.table.sim_index(self.d)
