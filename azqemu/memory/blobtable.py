"""The blob table: location, reference and refcount of every stored payload, and the per-domain
indices over it (content hash -> blob for DUP, sampled block hashes -> blob for SDELTA).

A blob is one encoded page payload in an arena. Sandbox index entries and SDELTA blobs hold
references to blobs; a blob whose count drops to 0 is freed. Blobs belong to exactly one
sharing domain and the indices are per domain, so a page of domain A can never be found as a
DUP target or SDELTA base by domain B. Template pages are outside this table: any domain may
reference them.

Blob ids of freed blobs are quarantined until a ``reclaim()`` (tried at the start of an encode,
under the encode lock) removes them from the similarity indices; only then can an id be reused,
so a stale index entry never points at a different page. The purge reads every index, so it
runs only once the quarantine holds an eighth of the indices' entries (amortised: a store whose
pages churn does not re-read its indices at every encode).

The DUP index is kept sorted and grows by merging each commit's new blobs into it; a freed blob
stays in it until a quarter of its entries are stale, then the index is rebuilt.
Every hit is checked against the table (live, same domain, same key), so a stale entry is never
returned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from azqemu.memory.attempts import AttemptOdds
from azqemu.memory.kinds import Method, RefType
from azqemu.memory.simindex import LayeredIndex, SimilarityIndex
from azqemu.pages import not_in_ids, unique_counts, unique_idx

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
# A PATCH against a template page (a few bytes away from it) stays out of the domain's DUP
# and similarity indices: such blobs are most of a store whose guests touch template pages
# lightly (70% of the blobs, 50 bytes of payload on average, measured on long-lived-heap), are
# seldom byte-equal across siblings (1.6% were shared), and a sibling page near one is near the
# template page too, which the template's own indices find. Half of their 72 bytes of metadata.
_PATCH, _ON_TEMPLATE = int(Method.PATCH), int(RefType.TEMPLATE)


def in_domain_indices(method: np.ndarray, reftype: np.ndarray) -> np.ndarray:
    """Which blobs (by their rows' method and reftype) enter their domain's DUP and
    similarity indices."""
    return ~((np.asarray(method) == _PATCH) & (np.asarray(reftype) == _ON_TEMPLATE))


# Below these, the DUP index is not rebuilt and the quarantine not purged: either would cost
# more than the stale entries do (they are only skipped at lookup).
DUP_REBUILD_MIN_STALE = 4096
RECLAIM_MIN_IDS = 4096


@dataclass
class DomainState:
    name: str
    did: int
    template_id: str
    sandboxes: set[str] = field(default_factory=set)
    dup_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    dup_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    dup_dirty: bool = True               # rebuild the DUP index from the table at next lookup
    dup_pending: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)  # new (keys, ids)
    dup_stale: int = 0                   # entries of dup_keys whose blob died since the build
    # New entries sorted apart (small: cheap to merge into), merged into dup_keys once they are
    # an eighth of it: merging every chunk's few hundred new blobs into a sorted index of the
    # whole domain took 8% of a long-lived-heap compression (session 18).
    dup_young_keys: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    dup_young_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    sim: SimilarityIndex = field(default_factory=SimilarityIndex.empty)
    sim_young: SimilarityIndex = field(default_factory=SimilarityIndex.empty)   # merged into sim later
    sim_pending: list[SimilarityIndex] = field(default_factory=list)
    # Which of the encoder's costlier attempts pay on this domain's pages (not persisted:
    # learned again after a restart within a few hundred pages).
    attempts: AttemptOdds = field(default_factory=AttemptOdds)


class BlobTable:
    def __init__(self, rows: np.ndarray | None = None, n: int = 0) -> None:
        self.rows = rows if rows is not None else np.zeros(1024, dtype=BLOB_DTYPE)
        self.n = n                         # high-water mark: ids < n were allocated once
        # Id lists as u32 arrays (4 bytes an id, not a Python int's 36): the quarantine holds
        # up to an eighth of the similarity entries between purges.
        self.free = np.zeros(0, np.uint32)          # reusable ids
        self.quarantine = np.zeros(0, np.uint32)    # freed, still possibly in a similarity index
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
            # The lowest free number: domains come and go (drop_empty_domains) for the store's life.
            did = next(i for i in range(len(self.domain_by_id) + 1) if i not in self.domain_by_id)
            if did >= MAX_DOMAINS:
                raise ValueError("too many sharing domains")
            d = DomainState(name, did, template_id)
            self.domains[name] = d
            self.domain_by_id[did] = d
        return d

    # -- allocation ---------------------------------------------------------------------
    def alloc(self, k: int) -> np.ndarray:
        take = min(k, len(self.free))
        keep = len(self.free) - take
        reused = self.free[keep:].astype(np.int64)
        self.free = self.free[:keep]
        extra = k - take
        if extra:
            if self.n + extra > MAX_BLOBS:
                raise ValueError("blob table full")
            need = self.n + extra
            if need > len(self.rows):
                grown = np.zeros(max(need, 2 * len(self.rows)), dtype=BLOB_DTYPE)
                grown[:self.n] = self.rows[:self.n]
                self.rows = grown
            first = self.n
            self.n = need
            if self.on_change is not None:
                self.on_change(self)
            return np.concatenate([reused, np.arange(first, need, dtype=np.int64)])
        return reused

    def live_mask(self) -> np.ndarray:
        return self.rows["refcount"][:self.n] > 0

    # -- references -----------------------------------------------------------------------
    def incref(self, ids: np.ndarray) -> None:
        if len(ids):
            np.add.at(self.rows["refcount"], np.asarray(ids, dtype=np.int64), 1)

    def decref(self, ids: np.ndarray) -> np.ndarray:
        """Drop one reference per id (repeats allowed); returns the ids freed (cascading to
        SDELTA bases). The caller releases their arena bytes before they are reused."""
        ids = np.asarray(ids, dtype=np.int64)
        freed: list[np.ndarray] = []
        while len(ids):
            rc = self.rows["refcount"]
            uniq, cnt = unique_counts(ids)
            if np.any(rc[uniq] < cnt):
                raise AssertionError("blob reference count underflow")
            rc[uniq] -= cnt.astype(np.uint32)
            dead = uniq[rc[uniq] == 0]
            freed.append(dead)
            indexed = dead[in_domain_indices(self.rows["method"][dead], self.rows["reftype"][dead])]
            doms, per = unique_counts(self.rows["domain"][indexed])
            for did, cnt in zip(doms.tolist(), per.tolist()):
                self.domain_by_id[did].dup_stale += cnt
            # A freed SDELTA blob releases its base.
            base = self.rows["reftype"][dead] == 2
            ids = self.rows["ref"][dead[base]].astype(np.int64)
        return np.concatenate(freed) if freed else np.zeros(0, np.int64)

    def retire(self, freed: np.ndarray) -> None:
        freed = np.asarray(freed, dtype=np.int64)
        if len(freed):
            self.rows[freed] = np.zeros((), dtype=BLOB_DTYPE)
            self.quarantine = np.concatenate([self.quarantine, freed.astype(np.uint32)])

    def reclaim(self, *, force: bool = False) -> None:
        """Purge quarantined ids from the similarity indices and make them reusable: once the
        quarantine holds an eighth of the indices' entries (or ``force``)."""
        if not len(self.quarantine):
            return
        if not force:
            entries = sum(len(d.sim) + len(d.sim_young) + sum(len(p) for p in d.sim_pending)
                          for d in self.domains.values())
            if len(self.quarantine) < max(RECLAIM_MIN_IDS, entries // 8):
                return
        dead = self.quarantine.astype(np.int64)
        for d in self.domains.values():
            self._merge_sim(d)
            if len(d.sim):
                keep = not_in_ids(d.sim.sources, dead)
                if not keep.all():
                    d.sim = SimilarityIndex(d.sim.keys[keep], d.sim.sources[keep])
        self.free = np.concatenate([self.free, self.quarantine])
        self.quarantine = np.zeros(0, np.uint32)

    def forget_domain(self, d: DomainState) -> None:
        """Drop the indices of a domain that holds no live blob any more (its last sandbox
        went): their entries all name dead blobs, and nothing would purge them until the
        domain's next encode. Its ids wait in the quarantine as any freed id does."""
        if not (self.live_mask() & (self.rows["domain"][:self.n] == d.did)).any():
            _clear_indices(d)

    def drop_empty_domains(self) -> bool:
        """Forget the domains that hold no sandbox and no live blob (their last sandbox went);
        an encode into one makes it again, and its number may go to another. Returns whether
        any went. The caller holds off every encode (one may be filling a domain it made)."""
        empty = [d for d in self.domains.values() if not d.sandboxes]
        if not empty:
            return False
        live_dids = set(unique_idx(self.rows["domain"][:self.n][self.live_mask()]).tolist())
        gone = [d for d in empty if d.did not in live_dids]
        for d in gone:
            del self.domains[d.name]
            del self.domain_by_id[d.did]
        return bool(gone)

    def reset_if_empty(self) -> bool:
        """With no live blob left, go back to the first size: the rows grown for a fleet of
        sandboxes are not kept once it is gone. The caller holds off every holder of blob
        ids (an encode's plan, a compaction)."""
        if self.n == 0 or self.live_mask().any():
            return False
        for d in self.domains.values():
            _clear_indices(d)
        self.rows = np.zeros(1024, dtype=BLOB_DTYPE)
        self.n = 0
        self.free, self.quarantine = np.zeros(0, np.uint32), np.zeros(0, np.uint32)
        if self.on_change is not None:
            self.on_change(self)
        return True

    # -- per-domain indices ------------------------------------------------------------------
    def add_dups(self, d: DomainState, keys: np.ndarray, ids: np.ndarray) -> None:
        """New blobs of domain ``d``: merged into its DUP index at the next lookup."""
        if len(ids) and not d.dup_dirty:
            d.dup_pending.append((np.asarray(keys, dtype=np.uint64), np.asarray(ids, dtype=np.uint32)))

    def _dup_index(self, d: DomainState) -> None:
        if d.dup_dirty or d.dup_stale > max(DUP_REBUILD_MIN_STALE, len(d.dup_keys) // 4):
            rows = self.rows[:self.n]
            live = np.flatnonzero(self.live_mask() & (rows["domain"] == d.did)
                                  & in_domain_indices(rows["method"], rows["reftype"]))
            keys = self.rows["key"][live]
            order = np.argsort(keys, kind="stable")
            d.dup_keys, d.dup_ids = keys[order], live[order].astype(np.uint32)
            d.dup_young_keys, d.dup_young_ids = np.zeros(0, np.uint64), np.zeros(0, np.uint32)
            d.dup_dirty, d.dup_pending, d.dup_stale = False, [], 0
        elif d.dup_pending:
            d.dup_young_keys, d.dup_young_ids = _merged_sorted([(d.dup_young_keys, d.dup_young_ids)] + d.dup_pending)
            d.dup_pending = []
            if 8 * len(d.dup_young_keys) > len(d.dup_keys):
                d.dup_keys, d.dup_ids = _merged_sorted([(d.dup_keys, d.dup_ids), (d.dup_young_keys, d.dup_young_ids)])
                d.dup_young_keys, d.dup_young_ids = np.zeros(0, np.uint64), np.zeros(0, np.uint32)

    def find_dups(self, d: DomainState, key: np.ndarray) -> np.ndarray:
        """The blob of domain ``d`` whose content hash is ``key`` (the newest one), or -1."""
        self._dup_index(d)
        key = np.asarray(key, dtype=np.uint64)
        found = np.full(len(key), -1, dtype=np.int64)
        # The young entries are the newer: asked first; the rest of the keys in the old ones.
        for keys, ids in ((d.dup_young_keys, d.dup_young_ids), (d.dup_keys, d.dup_ids)):
            todo = np.flatnonzero(found < 0)
            if len(keys) and len(todo):
                found[todo] = self._look_up_dups(d, keys, ids, key[todo])
        return found

    def _look_up_dups(self, d: DomainState, keys: np.ndarray, ids: np.ndarray, key: np.ndarray) -> np.ndarray:
        # The rightmost equal key is the newest entry: the likeliest to be live.
        pos = np.maximum(np.searchsorted(keys, key, side="right") - 1, 0)
        bid = ids[pos].astype(np.int64)
        rows = self.rows
        ok = (keys[pos] == key) & (bid < self.n)
        b = bid[ok]
        ok[ok] = (rows["refcount"][b] > 0) & (rows["domain"][b] == d.did) & (rows["key"][b] == key[ok])
        return np.where(ok, bid, -1)

    def add_sim(self, d: DomainState, fps: np.ndarray, ids: np.ndarray) -> None:
        if len(ids):
            fps = np.asarray(fps)[:, list(BLOB_SIM_SLOTS)]
            d.sim_pending.append(SimilarityIndex.build(fps, np.asarray(ids, dtype=np.uint32)))

    def _merge_sim(self, d: DomainState, *, full: bool = True) -> None:
        """Each commit's entries go into the young index (small: cheap to re-sort), the young
        one into the domain's once it holds an eighth as many entries (or ``full``)."""
        if d.sim_pending:
            d.sim_young, d.sim_pending = SimilarityIndex.merged([d.sim_young] + d.sim_pending), []
        if len(d.sim_young) and (full or 8 * len(d.sim_young) > len(d.sim)):
            d.sim, d.sim_young = SimilarityIndex.merged([d.sim, d.sim_young]), SimilarityIndex.empty()

    def sim_index(self, d: DomainState) -> SimilarityIndex | LayeredIndex:
        """The domain's similarity index for a query (the young entries not merged yet)."""
        self._merge_sim(d, full=False)
        return LayeredIndex(d.sim, d.sim_young) if len(d.sim_young) else d.sim

    def sim_entries_per_blob(self, d: DomainState) -> np.ndarray:
        """Number of similarity-index entries held by each blob id (length ``n``)."""
        return entries_per_blob(self.sim_sources(d), self.n)

    def sim_sources(self, d: DomainState) -> np.ndarray:
        """The blob id of every similarity-index entry of ``d``, young and pending ones too
        (a copy; no merge: the books need counts, not an ordered index)."""
        parts = [d.sim.sources, d.sim_young.sources] + [p.sources for p in d.sim_pending]
        return np.concatenate(parts).astype(np.int64)

    def sim_entry_bytes(self, d: DomainState) -> int:
        """Bytes of one entry of ``d``'s similarity index as merged (SimilarityIndex.merged
        keeps u32 sources, as the store file does). No merge for a figure: the young and
        pending entries cost the same once merged."""
        return int(d.sim.keys.itemsize + d.sim.sources.itemsize) if len(d.sim) else 12


def entries_per_blob(sources: np.ndarray, n: int) -> np.ndarray:
    """How many of ``sources`` (blob ids of index entries) name each blob id below ``n``."""
    return np.bincount(sources, minlength=n)[:n]


def _merged_sorted(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """(keys, ids) runs, each sorted by key, as one sorted run; equal keys keep the runs'
    order (the stable sort, timsort, merges sorted runs in linear time)."""
    keys = np.concatenate([k for k, _ in runs])
    ids = np.concatenate([i for _, i in runs])
    order = np.argsort(keys, kind="stable")
    return keys[order], ids[order]


def _clear_indices(d: DomainState) -> None:
    d.dup_keys, d.dup_ids = np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    d.dup_young_keys, d.dup_young_ids = np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    d.dup_dirty, d.dup_pending, d.dup_stale = True, [], 0
    d.sim, d.sim_young, d.sim_pending = SimilarityIndex.empty(), SimilarityIndex.empty(), []
