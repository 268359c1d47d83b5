"""The per-sandbox index: page index -> kind and reference, compact and sorted.

One sandbox's stored pages are described by five parallel numpy arrays sorted by page index
(14 bytes per entry). Runs of consecutive ZERO or TEMPLATE pages coalesce into one entry
(``count`` > 1), which keeps the index of a clone that is mostly template-identical small;
every other entry covers one page and names a blob (``ref``) or, for a DUP of a template page
(``flags & FLAG_REF_TEMPLATE``), the template page index.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from azqemu.memory.kinds import ENTRY_DTYPE, FLAG_REF_TEMPLATE, Kind

_RUN_KINDS = (int(Kind.ZERO), int(Kind.TEMPLATE))


@dataclass
class SandboxIndex:
    start: np.ndarray   # u4 first page index of the entry
    count: np.ndarray   # u4 pages covered
    kind: np.ndarray    # u1 Kind
    flags: np.ndarray   # u1
    ref: np.ndarray     # u4 blob id or template page index

    @classmethod
    def empty(cls) -> SandboxIndex:
        return cls(np.zeros(0, np.uint32), np.zeros(0, np.uint32), np.zeros(0, np.uint8),
                   np.zeros(0, np.uint8), np.zeros(0, np.uint32))

    @classmethod
    def from_pages(cls, page_idx: np.ndarray, kind: np.ndarray, flags: np.ndarray, ref: np.ndarray) -> SandboxIndex:
        """Build from one entry per page (any order, unique page indices); coalesces runs."""
        order = np.argsort(page_idx, kind="stable")
        p = np.asarray(page_idx, dtype=np.int64)[order]
        k = np.asarray(kind, dtype=np.uint8)[order]
        f = np.asarray(flags, dtype=np.uint8)[order]
        r = np.asarray(ref, dtype=np.uint32)[order]
        n = len(p)
        if n == 0:
            return cls.empty()
        runnable = np.isin(k, _RUN_KINDS)
        # A page continues the previous entry when both are the same run kind and adjacent.
        cont = np.zeros(n, dtype=bool)
        cont[1:] = runnable[1:] & (k[1:] == k[:-1]) & (p[1:] == p[:-1] + 1)
        heads = np.flatnonzero(~cont)
        counts = np.diff(np.append(heads, n))
        return cls(p[heads].astype(np.uint32), counts.astype(np.uint32), k[heads], f[heads], r[heads])

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One row per page: (page_idx int64, kind, flags, ref)."""
        c = self.count.astype(np.int64)
        rep = np.repeat(np.arange(len(c)), c)
        if len(rep) == 0:
            return (np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros(0, np.uint8), np.zeros(0, np.uint32))
        first = np.repeat(np.cumsum(c) - c, c)
        page = self.start.astype(np.int64)[rep] + (np.arange(len(rep)) - first)
        return page, self.kind[rep], self.flags[rep], self.ref[rep]

    def lookup(self, page_idx: np.ndarray) -> np.ndarray:
        """Entry number for each page index, -1 where the page is not stored."""
        p = np.asarray(page_idx, dtype=np.int64)
        if len(self.start) == 0:
            return np.full(len(p), -1, dtype=np.int64)
        e = np.searchsorted(self.start, p, side="right") - 1
        ec = np.maximum(e, 0)
        ok = (e >= 0) & (p < self.start[ec].astype(np.int64) + self.count[ec])
        return np.where(ok, e, -1)

    def lookup_one(self, page_idx: int) -> int:
        start = self.start
        if len(start) == 0:
            return -1
        e = int(start.searchsorted(page_idx, side="right")) - 1
        if e >= 0 and page_idx < int(start[e]) + int(self.count[e]):
            return e
        return -1

    @property
    def n_entries(self) -> int:
        return len(self.start)

    @property
    def n_pages(self) -> int:
        return int(self.count.sum(dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.n_entries * ENTRY_DTYPE.itemsize

    def blob_refs(self) -> np.ndarray:
        """Blob ids referenced by entries (one per page entry that holds a blob)."""
        m = ~np.isin(self.kind, _RUN_KINDS) & ((self.flags & FLAG_REF_TEMPLATE) == 0)
        return self.ref[m]

    def to_records(self) -> np.ndarray:
        rec = np.zeros(self.n_entries, dtype=ENTRY_DTYPE)
        rec["page_idx"], rec["count"], rec["kind"] = self.start, self.count, self.kind
        rec["flags"], rec["ref"] = self.flags, self.ref
        return rec

    @classmethod
    def from_records(cls, rec: np.ndarray) -> SandboxIndex:
        return cls(np.ascontiguousarray(rec["page_idx"]), np.ascontiguousarray(rec["count"]),
                   np.ascontiguousarray(rec["kind"]), np.ascontiguousarray(rec["flags"]),
                   np.ascontiguousarray(rec["ref"]))

    def kind_page_counts(self) -> np.ndarray:
        return np.bincount(self.kind, weights=self.count, minlength=len(Kind)).astype(np.int64)
