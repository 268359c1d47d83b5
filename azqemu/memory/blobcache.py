"""Decoded blobs the encoder asked for, kept across encodes of one store.

The encoder decodes blobs of the sharing domain to confirm a DUP bytewise and to use them as
SDELTA bases. Siblings of one template write much the same pages at every wait, so the same
blobs are asked for again by the next chunk, the next sibling and the next wait: decoding them
each time was a sixth of a coding-agent compression's CPU when the cache lived for one encode
call (one 2 MiB chunk).

A cached page is returned only while it is certainly the blob's content:
- the blob id has not been reused since it was decoded: ids become reusable only when the blob
  table releases its quarantine or empties (``BlobTable.reuse_epoch`` moves; the whole cache
  goes then), so an id names the same blob for as long as the cache holds it;
- the caller checks, under the store's lock, that the blob is still live and that its row's
  XXH3-128 (key, check) is the one the page was decoded under (``valid``).
The pages were verified against their check when decoded (blobdecode.decode_batch).

Bounded (``CAPACITY_PAGES``, 4 MiB) and filled first in, first out; the buffer is released
when the cache is cleared, so a manager whose sandboxes are gone holds none of it.
"""

from __future__ import annotations

import numpy as np

from azqemu.memory.kinds import PAGE_SIZE

CAPACITY_PAGES = 1024


class DecodedBlobCache:
    """Blob id -> decoded page, at most ``capacity`` pages; single-threaded use (the store's
    encodes are serialised by its encode lock)."""

    def __init__(self, capacity: int = CAPACITY_PAGES) -> None:
        self.capacity = capacity
        self.epoch = -1              # the table's reuse_epoch the entries were made under
        self.hits = 0
        self.misses = 0
        self._reset()

    def _reset(self) -> None:
        self._slot_of: dict[int, int] = {}
        self._id_at = np.full(self.capacity, -1, dtype=np.int64)
        self._key = np.zeros(self.capacity, dtype=np.uint64)
        self._check = np.zeros(self.capacity, dtype=np.uint64)
        self._pages: np.ndarray | None = None      # allocated at the first put
        self._next = 0

    def clear(self) -> None:
        """Forget every entry and release the page buffer."""
        self._reset()

    def slots(self, ids: np.ndarray, epoch: int) -> np.ndarray:
        """The cache slot of each blob id, -1 where not cached. Entries made under another
        ``epoch`` of the table are dropped first (their ids may name other blobs now)."""
        if epoch != self.epoch:
            self._reset()
            self.epoch = epoch
        get = self._slot_of.get
        return np.fromiter((get(b, -1) for b in ids.tolist()), dtype=np.int64, count=len(ids))

    def valid(self, slots: np.ndarray, key: np.ndarray, check: np.ndarray) -> np.ndarray:
        """Whether each slot's entry was decoded under this (key, check): the blob's row now."""
        return (self._key[slots] == key) & (self._check[slots] == check)

    def pages(self, slots: np.ndarray) -> np.ndarray:
        assert self._pages is not None
        return self._pages[slots]

    def note(self, hits: int, misses: int) -> None:
        self.hits += hits
        self.misses += misses

    def put(self, ids: np.ndarray, key: np.ndarray, check: np.ndarray, pages: np.ndarray) -> None:
        """Keep decoded ``pages`` of blobs ``ids`` (unique, not cached) under their rows'
        (key, check); the oldest entries make room."""
        ids = np.asarray(ids, dtype=np.int64)[-self.capacity:]
        key, check, pages = key[-self.capacity:], check[-self.capacity:], pages[-self.capacity:]
        if not len(ids):
            return
        if self._pages is None:
            self._pages = np.empty((self.capacity, PAGE_SIZE), dtype=np.uint8)
        at = (self._next + np.arange(len(ids))) % self.capacity
        self._next = int(at[-1] + 1) % self.capacity
        for old in self._id_at[at].tolist():
            if old >= 0:
                self._slot_of.pop(old, None)
        self._id_at[at], self._key[at], self._check[at] = ids, key, check
        self._pages[at] = pages
        self._slot_of.update(zip(ids.tolist(), at.tolist()))

    @property
    def held_bytes(self) -> int:
        return 0 if self._pages is None else self._pages.nbytes
