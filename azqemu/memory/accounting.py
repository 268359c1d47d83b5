"""Byte accounting of the page store: per sandbox, per sharing domain, per host.

What a sandbox owns (DESIGN.md, "Benchmark definitions"):
- ``private_bytes``: blobs only it references (payload plus the blob's metadata: its table row,
  its entry in the duplicate index and its entries in the similarity index);
- ``shared_bytes``: for every blob it shares, cost / refcount per reference it holds; an SDELTA
  blob's own reference to its base is passed on to the SDELTA blob's holders the same way;
- ``index_bytes``: its index entries and its list of RAW pages;
- ``raw_bytes``: pages left resident because nothing was profitable, 4096 each.
The shares are exact fractions of byte counts, so they are floats; summed over the sandboxes of
a domain they give the domain's bytes (tests check this).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from azqemu.memory.blobtable import (
    BLOB_DTYPE,
    DUP_INDEX_ENTRY_BYTES,
    BlobTable,
    DomainState,
    entries_per_blob,
    in_domain_indices,
)
from azqemu.memory.generation import StoredSandbox
from azqemu.memory.kinds import PAGE_SIZE


@dataclass(frozen=True)
class OwnedBytes:
    private_bytes: float
    shared_bytes: float
    index_bytes: int
    raw_bytes: int
    raw_pages: int
    stored_pages: int

    @property
    def total_bytes(self) -> float:
        return self.private_bytes + self.shared_bytes + self.index_bytes + self.raw_bytes

    def as_dict(self) -> dict[str, float | int]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


@dataclass(frozen=True)
class DomainBytes:
    domain: str
    sandboxes: int
    blob_bytes: int          # payloads + blob metadata of the domain's live blobs
    payload_bytes: int       # payloads alone
    index_bytes: int
    raw_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.blob_bytes + self.index_bytes + self.raw_bytes

    def as_dict(self) -> dict[str, int | str]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d


@dataclass(frozen=True)
class StoreBytes:
    domains: int
    sandboxes: int
    total_bytes: int           # sum over domains
    arena_used_bytes: int      # arena bytes written (live + dead, before compaction)
    arena_live_bytes: int
    template_bytes: int        # the templates' own data pages, reported separately
    arena_allocated_bytes: int = 0  # what the arena files hold in tmpfs (dead pages punched)

    @property
    def dead_overhead(self) -> float:
        """The factor on every sandbox's store bytes that shares out the arenas' dead bytes
        (not yet punched or compacted: nobody's, yet host memory) pro rata."""
        dead = max(0, self.arena_allocated_bytes - self.arena_live_bytes)
        return 1.0 + dead / self.total_bytes if self.total_bytes else 1.0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# The blob table's columns the books read.
_BOOKS_FIELDS = ("ref", "refcount", "length", "domain", "method", "reftype")


@dataclass(frozen=True)
class TableSnapshot:
    """What the books read of a store, copied under its state lock by ``of``: the arithmetic
    then runs without the lock, which every fault thread takes to look a page up (a sampler's
    books of 8 sandboxes held it 12-17 ms, each fault meanwhile stalling its vCPU). Answers
    the BlobTable calls the books make."""

    rows: np.ndarray                              # the columns of _BOOKS_FIELDS, rows[:n]
    n: int
    domains: dict[str, DomainState]
    members: dict[str, list[StoredSandbox]]       # by domain, in name order
    sandboxes: dict[str, StoredSandbox]           # shallow copies: the index and RAW list of then
    _sim_sources: dict[str, np.ndarray]
    _sim_bytes: dict[str, int]

    @classmethod
    def of(cls, table: BlobTable, sandboxes: dict[str, StoredSandbox], names: Iterable[str] | None = None,
           domains: Iterable[str] | None = None) -> TableSnapshot:
        """Call with the store's lock held: the books of ``names`` (default: every sandbox)
        and of ``domains`` (default: every domain)."""
        n = table.n
        rows = np.empty(n, dtype=[(f, BLOB_DTYPE.fields[f][0]) for f in _BOOKS_FIELDS])  # type: ignore[index]
        for f in _BOOKS_FIELDS:
            rows[f] = table.rows[f][:n]
        doms = dict(table.domains) if domains is None else {k: table.domains[k] for k in domains}
        want = sandboxes.keys() if names is None else [k for k in names if k in sandboxes]
        return cls(rows, n, doms,
                   {k: [copy.copy(sandboxes[s]) for s in sorted(d.sandboxes)] for k, d in doms.items()},
                   {k: copy.copy(sandboxes[k]) for k in want},
                   {k: table.sim_sources(d) for k, d in doms.items()},
                   {k: table.sim_entry_bytes(d) for k, d in doms.items()})

    def sim_entries_per_blob(self, d: DomainState) -> np.ndarray:
        return entries_per_blob(self._sim_sources[d.name], self.n)

    def sim_entry_bytes(self, d: DomainState) -> int:
        return self._sim_bytes[d.name]


def blob_costs(table: BlobTable | TableSnapshot, d: DomainState) -> np.ndarray:
    """Cost of each blob id of domain ``d`` (0 for others): payload + metadata bytes."""
    n = table.n
    rows = table.rows[:n]
    live = (rows["refcount"] > 0) & (rows["domain"] == d.did)
    cost = rows["length"].astype(np.float64) + BLOB_DTYPE.itemsize
    cost += np.where(in_domain_indices(rows["method"], rows["reftype"]), DUP_INDEX_ENTRY_BYTES, 0)
    cost += table.sim_entries_per_blob(d) * table.sim_entry_bytes(d)
    return np.where(live, cost, 0.0)


def sandbox_shares(table: BlobTable | TableSnapshot, cost: np.ndarray, refs: np.ndarray) -> tuple[float, float]:
    """(private, shared) bytes for a sandbox holding one reference to each blob in ``refs``."""
    if len(refs) == 0:
        return 0.0, 0.0
    refs = refs.astype(np.int64)
    rows = table.rows
    rc = rows["refcount"][refs].astype(np.float64)
    own = cost[refs] / rc
    based = rows["reftype"][refs] == 2
    if based.any():
        base = rows["ref"][refs[based]].astype(np.int64)
        own[based] += cost[base] / rows["refcount"][base].astype(np.float64) / rc[based]
    single = rc == 1
    # A based blob held once still shares its base: split exactly by where the bytes sit.
    private = float(own[single & ~based].sum())
    if (single & based).any():
        sb = refs[single & based]
        private += float(cost[sb].sum())
    shared = float(own.sum()) - private
    return private, shared


def raw_page_bytes(n_raw: int) -> int:
    return n_raw * PAGE_SIZE


def sandbox_books(table: BlobTable | TableSnapshot, sandboxes: Iterable[StoredSandbox],
                  costs: dict[str, np.ndarray] | None = None) -> dict[str, OwnedBytes]:
    """``OwnedBytes`` of each sandbox by name, the blob costs of each sharing domain computed
    once: a sampling of 16 sandboxes otherwise walks the whole blob table 16 times (a fifth of
    the manager's CPU in a density run). ``costs``: ``blob_costs`` by domain name, if known."""
    costs = {} if costs is None else costs
    out = {}
    for sb in sandboxes:
        cost = costs.get(sb.domain.name)
        if cost is None:
            cost = costs[sb.domain.name] = blob_costs(table, sb.domain)
        private, shared = sandbox_shares(table, cost, sb.index.blob_refs())
        out[sb.name] = OwnedBytes(private, shared, sb.index.nbytes + sb.raw.nbytes,
                                  raw_page_bytes(len(sb.raw)), len(sb.raw), sb.index.n_pages)
    return out


def domain_books(table: BlobTable | TableSnapshot, d: DomainState, sandboxes: list[StoredSandbox],
                 cost: np.ndarray | None = None) -> DomainBytes:
    """``DomainBytes`` of sharing domain ``d`` whose sandboxes are ``sandboxes`` (``cost``:
    its ``blob_costs``, if known)."""
    cost = blob_costs(table, d) if cost is None else cost
    rows = table.rows[:table.n]
    mine = (rows["refcount"] > 0) & (rows["domain"] == d.did)
    return DomainBytes(d.name, len(sandboxes), int(round(cost.sum())), int(rows["length"][mine].sum()),
                       sum(s.index.nbytes + s.raw.nbytes for s in sandboxes),
                       sum(raw_page_bytes(len(s.raw)) for s in sandboxes))


def store_books(snap: TableSnapshot) -> tuple[int, dict[str, OwnedBytes]]:
    """Every domain's ``DomainBytes.total_bytes`` summed, and the ``OwnedBytes`` of the
    snapshot's sandboxes: each domain's blob costs computed once for both (a 1 Hz sampler
    asking for the two walked the blob table twice a domain)."""
    costs = {name: blob_costs(snap, d) for name, d in snap.domains.items()}
    total = sum(domain_books(snap, d, snap.members[name], costs[name]).total_bytes
                for name, d in snap.domains.items())
    return total, sandbox_books(snap, snap.sandboxes.values(), costs)
