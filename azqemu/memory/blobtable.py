"""The blob table: location, reference and refcount of every stored payload, and the per-domain
indices over it (content hash -> blob for DUP, sampled block hashes -> blob for SDELTA).

A blob is one encoded page payload in an arena. Sandbox index entries and SDELTA blobs hold
references to blobs; a blob whose count drops to 0 is freed. Blobs belong to exactly one
sharing domain and the indices are per domain, so a page of domain A can never be found as a
DUP target or SDELTA base by domain B. Template pages are outside this table: any domain may
reference them.

Blob ids of freed blobs are quarantined until the next ``reclaim()`` (called at the start of an
encode, under the encode lock) removes them from the similarity indices; only then can an id be
reused, so a stale index entry never points at a different page.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from azqemu.memory.simindex import SimilarityIndex

BLOB_DTYPE = np.dtype([("key", "<u8"), ("check", "<u8"), ("offset", "<u4"), ("ref", "<u4"),
                       ("refcount", "<u4"), ("arena", "<u2"), ("length", "<u2"), ("domain", "<u2"),
                       ("method", "u1"), ("reftype", "u1")])      # 36 bytes
DUP_INDEX_ENTRY_BYTES = 8 + 4        # u64 key + u32 blob id
# Blobs enter their domain's similarity index with two of the four sampled blocks (Difference
# Engine's two): each entry costs 12 bytes per blob, owned by the sandboxes, whereas the
# template's index (all four samples) is the template's cost.
BLOB_SIM_SLOTS = (0, 2)
MAX_BLOBS = (1 << 32) - 2
MAX_DOMAINS = (1 << 16) - 1


@dataclass
class DomainState:
    name: str
    did: int
    template_id: str
    sandboxes: set[str] = field(default_factory=set)
    dup_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    dup_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    dup_dirty: bool = True
    sim: SimilarityIndex = field(default_factory=SimilarityIndex.empty)
    sim_pending: list[SimilarityIndex] = field(default_factory=list)


class BlobTable:
    def __init__(self, rows: np.ndarray | None = None, n: int = 0) -> None:
        self.rows = rows if rows is not None else np.zeros(1024, dtype=BLOB_DTYPE)
        self.n = n                         # high-water mark: ids < n were allocated once
        self.free: list[int] = []          # reusable ids
        self.quarantine: list[int] = []    # freed, still possibly in a similarity index
        self.domains: dict[str, DomainState] = {}
        self.domain_by_id: dict[int, DomainState] = {}
        # Called (under the store's lock) when ``rows`` or ``n`` changes: the native lookup
        # reads them (nativestore.py).
        self.on_change: Callable[[BlobTable], None] | None = None

    # -- domains ------------------------------------------------------------------------
    def domain(self, name: str, template_id: str, create: bool = True) -> DomainState:
        d = self.domains.get(name)
        if d is None:
            if not create:
                raise KeyError(name)
            did = max(self.domain_by_id, default=-1) + 1
            if did >= MAX_DOMAINS:
                raise ValueError("too many sharing domains")
            d = DomainState(name, did, template_id)
            self.domains[name] = d
            self.domain_by_id[did] = d
        return d

    # -- allocation ---------------------------------------------------------------------
    def alloc(self, k: int) -> np.ndarray:
        take = min(k, len(self.free))
        ids = [self.free.pop() for _ in range(take)]
        extra = k - take
        if extra:
            if self.n + extra > MAX_BLOBS:
                raise ValueError("blob table full")
            need = self.n + extra
            if need > len(self.rows):
                grown = np.zeros(max(need, 2 * len(self.rows)), dtype=BLOB_DTYPE)
                grown[:self.n] = self.rows[:self.n]
                self.rows = grown
            ids.extend(range(self.n, need))
            self.n = need
            if self.on_change is not None:
                self.on_change(self)
        return np.array(ids, dtype=np.int64)

    def live_mask(self) -> np.ndarray:
        return self.rows["refcount"][:self.n] > 0

    # -- references -----------------------------------------------------------------------
    def incref(self, ids: np.ndarray) -> None:
        if len(ids):
            np.add.at(self.rows["refcount"], np.asarray(ids, dtype=np.int64), 1)

    def decref(self, ids: np.ndarray) -> list[int]:
        """Drop one reference per id (repeats allowed); returns the ids freed (cascading to
        SDELTA bases). The caller releases their arena bytes before they are reused."""
        ids = np.asarray(ids, dtype=np.int64)
        freed: list[int] = []
        while len(ids):
            rc = self.rows["refcount"]
            uniq, cnt = np.unique(ids, return_counts=True)
            if np.any(rc[uniq] < cnt):
                raise AssertionError("blob reference count underflow")
            rc[uniq] -= cnt.astype(np.uint32)
            dead = uniq[rc[uniq] == 0]
            freed.extend(int(b) for b in dead)
            for b in dead:
                self.domain_by_id[int(self.rows["domain"][b])].dup_dirty = True
            # A freed SDELTA blob releases its base.
            base = self.rows["reftype"][dead] == 2
            ids = self.rows["ref"][dead[base]].astype(np.int64)
        return freed

    def retire(self, freed: list[int]) -> None:
        for b in freed:
            self.rows[b] = np.zeros((), dtype=BLOB_DTYPE)
        self.quarantine.extend(freed)

    def reclaim(self) -> None:
        """Purge quarantined ids from the similarity indices and make them reusable."""
        if not self.quarantine:
            return
        dead = np.array(self.quarantine, dtype=np.int64)
        for d in self.domains.values():
            self._merge_sim(d)
            if len(d.sim):
                keep = ~np.isin(d.sim.sources, dead)
                if not keep.all():
                    d.sim = SimilarityIndex(d.sim.keys[keep], d.sim.sources[keep])
        self.free.extend(self.quarantine)
        self.quarantine = []

    # -- per-domain indices ------------------------------------------------------------------
    def find_dups(self, d: DomainState, key: np.ndarray) -> np.ndarray:
        if d.dup_dirty:
            live = np.flatnonzero(self.live_mask() & (self.rows["domain"][:self.n] == d.did))
            keys = self.rows["key"][live]
            order = np.argsort(keys, kind="stable")
            d.dup_keys, d.dup_ids = keys[order], live[order].astype(np.uint32)
            d.dup_dirty = False
        if len(d.dup_keys) == 0:
            return np.full(len(key), -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(d.dup_keys, key), len(d.dup_keys) - 1)
        return np.where(d.dup_keys[pos] == key, d.dup_ids[pos].astype(np.int64), -1)

    def add_sim(self, d: DomainState, fps: np.ndarray, ids: np.ndarray) -> None:
        if len(ids):
            fps = np.asarray(fps)[:, list(BLOB_SIM_SLOTS)]
            d.sim_pending.append(SimilarityIndex.build(fps, np.asarray(ids, dtype=np.uint32)))

    def _merge_sim(self, d: DomainState) -> None:
        if d.sim_pending:
            keys = np.concatenate([d.sim.keys] + [p.keys for p in d.sim_pending])
            src = np.concatenate([d.sim.sources.astype(np.uint32)] + [p.sources for p in d.sim_pending])
            order = np.argsort(keys, kind="stable")
            d.sim = SimilarityIndex(keys[order], src[order])
            d.sim_pending = []

    def sim_index(self, d: DomainState) -> SimilarityIndex:
        self._merge_sim(d)
        return d.sim

    def sim_entries_per_blob(self, d: DomainState) -> np.ndarray:
        """Number of similarity-index entries held by each blob id (length ``n``)."""
        self._merge_sim(d)
        if len(d.sim) == 0:
            return np.zeros(self.n, dtype=np.int64)
        return np.bincount(d.sim.sources.astype(np.int64), minlength=self.n)[:self.n]

    def sim_entry_bytes(self, d: DomainState) -> int:
        self._merge_sim(d)
        return d.sim.keys.itemsize + d.sim.sources.itemsize if len(d.sim) else 12
