"""The per-sandbox index: page index -> kind and reference, compact and sorted.

Two parts:
- a 2-bit map over the sandbox's page indices for the pages that need no data (ZERO,
  TEMPLATE): 4 pages per byte, so a 512 MiB sandbox pays at most 32 KiB however its zero and
  template-identical pages are scattered (run-length entries cost 9+ bytes per run and real
  clones have their template-identical pages in many short runs);
- sorted entries of 10 bytes for every other stored page, naming a blob (``ref``) or, for a
  DUP of a template page (``flags & FLAG_REF_TEMPLATE``), the template page index.
Map values: 0 = look in the entries (or not stored), 1 = ZERO, 2 = TEMPLATE.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from azqemu.memory.kinds import ENTRY_DTYPE, FLAG_REF_TEMPLATE, Kind

_MAP_ZERO, _MAP_TEMPLATE = 1, 2
_KIND_OF_MAP = np.array([255, int(Kind.ZERO), int(Kind.TEMPLATE), 255], dtype=np.uint8)
_SHIFTS = np.array([0, 2, 4, 6], dtype=np.uint8)


def _pack(page_idx: np.ndarray, value: np.ndarray, n_slots: int) -> bytearray:
    # Page indices are unique: their 2-bit fields never overlap, so adding them into their
    # bytes is or-ing them. O(pages in the map), not O(slots): a compression commits often.
    packed = np.zeros((n_slots + 3) // 4, dtype=np.uint8)
    p = np.asarray(page_idx, dtype=np.int64)
    np.add.at(packed, p >> 2, (np.asarray(value, dtype=np.uint8) << ((p & 3) * 2).astype(np.uint8)))
    return bytearray(packed.tobytes())


def _apply_fields(packed: np.ndarray, pages: np.ndarray, value: np.ndarray, *, clear: bool = False) -> None:
    """Set (or, ``clear``, zero) the 2-bit fields of ``pages`` (ascending, unique) in ``packed``:
    the fields sharing a byte are or-ed together first (reduceat), one write per byte."""
    if not len(pages):
        return
    byte = pages >> 2
    fields = (value.astype(np.uint8) << ((pages & 3) * 2).astype(np.uint8)).astype(np.uint8)
    ub, first = np.unique(byte, return_index=True)
    merged = np.bitwise_or.reduceat(fields, first)
    if clear:
        packed[ub] &= ~merged
    else:
        packed[ub] |= merged


def _field_counts(value: int) -> np.ndarray:
    """For each byte 0-255: how many of its four 2-bit fields equal ``value`` (0: non-zero)."""
    b = np.arange(256, dtype=np.uint8)
    fields = (b[:, None] >> _SHIFTS) & 3
    return ((fields != 0) if value == 0 else (fields == value)).sum(axis=1).astype(np.int64)


_NONZERO_FIELDS, _ZERO_FIELDS, _TEMPLATE_FIELDS = _field_counts(0), _field_counts(_MAP_ZERO), _field_counts(_MAP_TEMPLATE)


@dataclass
class SandboxIndex:
    zt: bytearray        # 2-bit map, 4 pages per byte (page p: byte p >> 2, bits 2*(p & 3))
    page: np.ndarray     # u4 sorted page indices of the data entries
    kind: np.ndarray     # u1 Kind
    flags: np.ndarray    # u1
    ref: np.ndarray      # u4 blob id or template page index

    @classmethod
    def empty(cls) -> SandboxIndex:
        return cls(bytearray(), np.zeros(0, np.uint32), np.zeros(0, np.uint8), np.zeros(0, np.uint8),
                   np.zeros(0, np.uint32))

    @classmethod
    def from_pages(cls, page_idx: np.ndarray, kind: np.ndarray, flags: np.ndarray, ref: np.ndarray) -> SandboxIndex:
        """Build from one row per page (any order, unique page indices)."""
        p = np.asarray(page_idx, dtype=np.int64)
        k = np.asarray(kind, dtype=np.uint8)
        m_zero, m_tpl = k == int(Kind.ZERO), k == int(Kind.TEMPLATE)
        in_map = m_zero | m_tpl
        if in_map.any():
            value = np.where(m_zero[in_map], _MAP_ZERO, _MAP_TEMPLATE).astype(np.uint8)
            zt = _pack(p[in_map], value, int(p[in_map].max()) + 1)
        else:
            zt = bytearray()
        data = ~in_map
        order = np.argsort(p[data], kind="stable")
        return cls(zt, p[data][order].astype(np.uint32), k[data][order],
                   np.asarray(flags, dtype=np.uint8)[data][order], np.asarray(ref, dtype=np.uint32)[data][order])

    def replaced(self, remove: np.ndarray, page_idx: np.ndarray, kind: np.ndarray, flags: np.ndarray,
                 ref: np.ndarray) -> tuple[SandboxIndex, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """This index less the pages ``remove`` (ascending, unique) plus the rows given (pages
        among ``remove`` or new; any order), and the (kind, flags, ref) of the rows removed.
        O(rows changed) lookups plus copies of the arrays: a compression commits every 2 MiB
        chunk, and rebuilding the whole index each time (``expand`` then ``from_pages``: two
        sorts of every stored page) was a fifth of a compression's CPU on a 1 GiB sandbox."""
        remove = np.asarray(remove, dtype=np.int64)
        found, old_k, old_f, old_r = self.lookup(remove)
        p = np.asarray(page_idx, dtype=np.int64)
        k = np.asarray(kind, dtype=np.uint8)
        m_zero, m_tpl = k == int(Kind.ZERO), k == int(Kind.TEMPLATE)
        in_map = m_zero | m_tpl
        # The map: the removed pages' fields cleared, the new map pages' fields set.
        mp = p[in_map]
        n_bytes = max(len(self.zt), (int(mp.max()) >> 2) + 1 if len(mp) else 0)
        packed = np.zeros(n_bytes, dtype=np.uint8)
        packed[:len(self.zt)] = np.frombuffer(self.zt, dtype=np.uint8)
        gone = remove[found & (remove < 4 * len(self.zt))]
        _apply_fields(packed, gone, np.full(len(gone), 3, dtype=np.uint8), clear=True)
        order = np.argsort(mp)
        _apply_fields(packed, mp[order], np.where(m_zero[in_map], _MAP_ZERO, _MAP_TEMPLATE).astype(np.uint8)[order])
        if len(gone) and n_bytes and packed[-1] == 0:
            # The map ends at its highest page still in it. A copy-on-write clone's map empties
            # at every compression's map-back: kept at full length it held 32 KiB of zeros per
            # 512 MiB sandbox three times over (this index, the fault path's copy, the index file).
            packed = np.trim_zeros(packed, "b")
            n_bytes = len(packed)
        # The entries: the removed ones deleted, the new ones inserted in page order.
        page, ek, ef, er = self.page, self.kind, self.flags, self.ref
        if len(page) and len(remove):
            # Needles in the entries' own dtype: no cast of the whole array (lookup_one).
            r32 = remove[(remove >= 0) & (remove <= 0xFFFFFFFF)].astype(np.uint32)
            at = np.searchsorted(page, r32)
            inside = at < len(page)
            at = at[inside][page[at[inside]] == r32[inside]]
            if len(at):
                page, ek, ef, er = (np.delete(a, at) for a in (page, ek, ef, er))
        data = ~in_map
        if data.any():
            order = np.argsort(p[data], kind="stable")
            dp = p[data][order].astype(np.uint32)
            at = np.searchsorted(page, dp)
            page = np.insert(page, at, dp)
            ek = np.insert(ek, at, k[data][order])
            ef = np.insert(ef, at, np.asarray(flags, dtype=np.uint8)[data][order])
            er = np.insert(er, at, np.asarray(ref, dtype=np.uint32)[data][order])
        index = SandboxIndex(bytearray(packed.tobytes()) if n_bytes else bytearray(),
                             np.ascontiguousarray(page, dtype=np.uint32), np.ascontiguousarray(ek, dtype=np.uint8),
                             np.ascontiguousarray(ef, dtype=np.uint8), np.ascontiguousarray(er, dtype=np.uint32))
        return index, (old_k[found], old_f[found], old_r[found])

    def _map_values(self) -> np.ndarray:
        if not self.zt:
            return np.zeros(0, dtype=np.uint8)
        packed = np.frombuffer(self.zt, dtype=np.uint8)
        return ((packed[:, None] >> _SHIFTS) & 3).reshape(-1)

    def _map_pages(self) -> tuple[np.ndarray, np.ndarray]:
        """(page indices, map values) of the pages in the map, ascending: only the non-zero
        bytes are unpacked (the map spans the highest page ever mapped; few pages are in it)."""
        if not self.zt:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
        packed = np.frombuffer(self.zt, dtype=np.uint8)
        nz = np.flatnonzero(packed)
        vals = ((packed[nz][:, None] >> _SHIFTS) & 3).reshape(-1)
        pages = (nz[:, None] * 4 + np.arange(4)).reshape(-1)
        set_ = vals != 0
        return pages[set_], vals[set_]

    def expand(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """One row per stored page, sorted by page index: (page_idx int64, kind, flags, ref)."""
        mp, vals = self._map_pages()
        p = np.concatenate([mp, self.page.astype(np.int64)])
        k = np.concatenate([_KIND_OF_MAP[vals], self.kind])
        f = np.concatenate([np.zeros(len(mp), np.uint8), self.flags])
        r = np.concatenate([np.zeros(len(mp), np.uint32), self.ref])
        order = np.argsort(p, kind="stable")
        return p[order], k[order], f[order], r[order]

    def lookup(self, page_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(found, kind, flags, ref) for each page index."""
        p = np.asarray(page_idx, dtype=np.int64)
        n = len(p)
        kind = np.zeros(n, dtype=np.uint8)
        flags = np.zeros(n, dtype=np.uint8)
        ref = np.zeros(n, dtype=np.uint32)
        found = np.zeros(n, dtype=bool)
        if self.zt:
            packed = np.frombuffer(self.zt, dtype=np.uint8)
            inside = (p >= 0) & (p < len(packed) * 4)
            pi = np.where(inside, p, 0)
            v = np.where(inside, (packed[pi >> 2] >> ((pi & 3) * 2).astype(np.uint8)) & 3, 0)
            hit = v > 0
            kind[hit] = _KIND_OF_MAP[v[hit]]
            found |= hit
        if len(self.page):
            # Needles in the entries' own dtype (u4): an int64 needle casts the whole array.
            rest = np.flatnonzero(~found & (p >= 0) & (p <= 0xFFFFFFFF))
            pr = p[rest].astype(np.uint32)
            e = np.searchsorted(self.page, pr)
            ec = np.minimum(e, len(self.page) - 1)
            ok = self.page[ec] == pr
            r_ok, e_ok = rest[ok], ec[ok]
            kind[r_ok], flags[r_ok], ref[r_ok] = self.kind[e_ok], self.flags[e_ok], self.ref[e_ok]
            found[r_ok] = True
        return found, kind, flags, ref

    def lookup_one(self, page_idx: int) -> tuple[int, int, int] | None:
        """(kind, flags, ref) of one page, or None: the fault path, so plain Python where it can."""
        zt = self.zt
        byte = page_idx >> 2
        if 0 <= byte < len(zt):
            v = (zt[byte] >> ((page_idx & 3) << 1)) & 3
            if v == _MAP_ZERO:
                return int(Kind.ZERO), 0, 0
            if v == _MAP_TEMPLATE:
                return int(Kind.TEMPLATE), 0, 0
        pages = self.page
        if len(pages) == 0 or not 0 <= page_idx <= 0xFFFFFFFF:
            return None
        # The needle in the array's own dtype: a Python int makes numpy cast the whole u4
        # array to int64 first (O(n): 3.5 us at 5k entries, 25 us at 100k, on every fault).
        e = int(pages.searchsorted(np.uint32(page_idx)))
        if e < len(pages) and int(pages[e]) == page_idx:
            return int(self.kind[e]), int(self.flags[e]), int(self.ref[e])
        return None

    @property
    def n_entries(self) -> int:
        return len(self.page)

    @property
    def n_pages(self) -> int:
        packed = np.frombuffer(self.zt, dtype=np.uint8)
        return int(_NONZERO_FIELDS[packed].sum()) + len(self.page)

    @property
    def nbytes(self) -> int:
        return len(self.zt) + self.n_entries * ENTRY_DTYPE.itemsize

    def blob_refs(self) -> np.ndarray:
        """Blob ids referenced by entries (one per page that holds a blob reference)."""
        return self.ref[(self.flags & FLAG_REF_TEMPLATE) == 0]

    def to_records(self) -> np.ndarray:
        rec = np.zeros(self.n_entries, dtype=ENTRY_DTYPE)
        rec["page_idx"], rec["kind"], rec["flags"], rec["ref"] = self.page, self.kind, self.flags, self.ref
        return rec

    @classmethod
    def from_parts(cls, zt: bytes, rec: np.ndarray) -> SandboxIndex:
        return cls(bytearray(zt), np.ascontiguousarray(rec["page_idx"]), np.ascontiguousarray(rec["kind"]),
                   np.ascontiguousarray(rec["flags"]), np.ascontiguousarray(rec["ref"]))

    def kind_page_counts(self) -> np.ndarray:
        packed = np.frombuffer(self.zt, dtype=np.uint8)
        counts = np.bincount(self.kind, minlength=len(Kind)).astype(np.int64)
        counts[int(Kind.ZERO)] += int(_ZERO_FIELDS[packed].sum())
        counts[int(Kind.TEMPLATE)] += int(_TEMPLATE_FIELDS[packed].sum())
        return counts

    def check(self) -> str | None:
        """A description of the first inconsistency, or None (used when loading from disk)."""
        vals = self._map_values()
        if (vals == 3).any():
            return "bad map value"
        if len(self.page):
            if (np.diff(self.page.astype(np.int64)) <= 0).any():
                return "entries not sorted"
            if not np.isin(self.kind, (int(Kind.DUP), int(Kind.TDELTA), int(Kind.SDELTA), int(Kind.ZSTD),
                                        int(Kind.LZ4))).all():
                return "bad entry kind"
            inside = self.page.astype(np.int64) < len(vals)
            if (vals[self.page[inside].astype(np.int64)] != 0).any():
                return "a page is both mapped and an entry"
            if ((self.flags & FLAG_REF_TEMPLATE) != 0)[self.kind != int(Kind.DUP)].any():
                return "template reference on a non-DUP entry"
        return None
