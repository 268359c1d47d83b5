"""Incompressible pages a compression left resident, and the content it found them with.

A page whose best encoding is not worth storing (Kind.RAW: random data, already compressed
files) stays resident, and the store names it without a hash. Every compression read such a
page again and ran the whole encoder on it (the template and sibling lookups, the codec
attempts), to find it RAW again: a guest holding 64 MiB of gzip output or random bytes paid
that at every LLM wait. The record keeps each RAW page's XXH3-128 as the encoder saw it; the
next compression leaves a page whose hash has not moved where it is, untried, as trims
already did between compressions (coldrule.CopyHistory's ``raw``).

What a skipped page could have become: nothing the template offers (an unchanged page meets
the same template), only a delta against a sibling's blob stored since, for a page that was
too far from every sibling the first time. A guest that writes the page gets it tried again.
A skipped page is never dropped: it is resident, and the store holds no entry for it (a page
a trim encoded since, whose content came back to what it was, is tried: its encode replaces
the trim's entry).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from azqemu.memory.kinds import Kind
from azqemu.memory.store import PageStore
from azqemu.pages import in_sorted


@dataclass
class RawRecord:
    """Page indices (ascending) and the XXH3-128 (``key``, ``check``) of their content when a
    compression found them incompressible."""

    idx: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    key: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))
    check: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))

    @classmethod
    def of(cls, idx: np.ndarray, key: np.ndarray, check: np.ndarray) -> RawRecord:
        """From rows in any order (unique page indices)."""
        idx = np.asarray(idx, dtype=np.int64)
        order = np.argsort(idx, kind="stable")
        return cls(idx[order], np.asarray(key, dtype=np.uint64)[order], np.asarray(check, dtype=np.uint64)[order])

    def same(self, idx: np.ndarray, key: np.ndarray, check: np.ndarray) -> np.ndarray:
        """For pages ``idx`` whose content hashes to ``key``/``check`` now: whether each was
        RAW with exactly this content."""
        idx = np.asarray(idx, dtype=np.int64)
        if not len(self.idx) or not len(idx):
            return np.zeros(len(idx), dtype=bool)
        pos = np.minimum(np.searchsorted(self.idx, idx), len(self.idx) - 1)
        return (self.idx[pos] == idx) & (self.key[pos] == key) & (self.check[pos] == check)

    def __len__(self) -> int:
        return len(self.idx)

    @property
    def nbytes(self) -> int:
        return int(self.idx.nbytes + self.key.nbytes + self.check.nbytes)


class RawPass:
    """One compression's use of the record for sandbox ``name`` of ``store`` (``held``: the
    store holds entries of it): the pages of each chunk it leaves untried, the pages it tried,
    and the record it leaves. Only a page the store holds no entry for is left untried: one a
    trim (or a cancelled compression) gave an entry since is tried, and its encode replaces
    that entry."""

    def __init__(self, record: RawRecord, store: PageStore, name: str, held: bool) -> None:
        self.record = record
        self.stored_nothing: Callable[[np.ndarray], np.ndarray] | None = None   # None: it holds nothing
        if held:
            self.stored_nothing = lambda pages: store.page_kinds(name, pages) == int(Kind.RAW)
        self.untried_pages = 0
        self._rows: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []    # untried: (idx, key, check)
        self._tried: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def untried(self, idx: np.ndarray, key: np.ndarray, check: np.ndarray, skip: np.ndarray) -> np.ndarray:
        """Of a chunk's pages (those in ``skip`` are dropped for another reason), the ones left
        untried; the rest are noted as tried."""
        was_raw = self.record.same(idx, key, check) & ~skip
        if was_raw.any() and self.stored_nothing is not None:
            was_raw[was_raw] = self.stored_nothing(idx[was_raw])
        self._rows.append((idx[was_raw], key[was_raw], check[was_raw]))
        self.untried_pages += int(np.count_nonzero(was_raw))
        rest = ~(was_raw | skip)
        self._tried.append((idx[rest], key[rest], check[rest]))
        return was_raw

    def after(self, enc_raw: np.ndarray) -> RawRecord:
        """The record this compression leaves: the pages it tried that came out RAW
        (``enc_raw``, ascending) and those it left untried, each with the hash it saw."""
        rows = list(self._rows)
        for idx, key, check in self._tried:
            raw = in_sorted(idx, enc_raw)
            rows.append((idx[raw], key[raw], check[raw]))
        if not rows:
            return RawRecord()
        return RawRecord.of(*(np.concatenate([r[i] for r in rows]) for i in range(3)))
