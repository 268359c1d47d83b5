"""Which copies a trim drops: a running copy-on-write sandbox's copies sorted chunk by chunk.

A trim (SandboxMemory.trim) reads every copy the sandbox holds and sorts it into one of:
- *same*: equal to its stored entry (brought back at resume, not written since) and not
  faulted back in this phase: dropped without encoding, once the prefetch is as old as the
  cold age;
- *zero*: all zero (the guest freed it: its kernel runs with ``init_on_free=1``, or wrote
  zeros): encoded as ZERO, which costs no store space, and dropped at once, cold or not.
  The drop maps the zero page in its place (SandboxMemory._settle), so the guest's next read
  costs nothing and its next write is the kernel's copy-on-write of the zero page, as its
  first write was: no fault reaches the manager. A tool call that frees hundreds of MiB
  (a process exits, a cache is cleared) gives them back within one trim instead of a cold
  age (service-agent, session 23);
- *cold*: written, its hash unmoved for the cold age (coldrule.py), neither faulted back nor
  RAW with that hash: encoded, then dropped;
- the rest stays.
Zero drops are not the cold rule's to judge: no fault can show whether they came back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from azqemu.daemon.coldrule import CopyHistory
from azqemu.daemon.ramscan import without_rows
from azqemu.memory.pagehash import ZERO_CHECK, ZERO_KEY, page_hashes
from azqemu.pages import Scratch, in_sorted

# (pages, keys, checks) -> per page: equal to its stored entry
EntriesMatch = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False        # handed out by the properties: shared


class TrimSort:
    """The sort of one trim's copies ``idx`` (sorted page indices) at monotonic ``now``."""

    def __init__(self, idx: np.ndarray, now: float, *, faulted: np.ndarray, cold_after_s: float,
                 prefetch_cold: bool, history: CopyHistory, entries_match: EntriesMatch) -> None:
        self.idx, self.now = idx, now
        self.faulted = faulted                  # came back from the store in this phase: in use
        self.cold_after_s = cold_after_s
        self.prefetch_cold = prefetch_cold      # the last prefetch is as old as the cold age
        self.history = history
        self.entries_match = entries_match
        # Per copy of idx; a cancel may leave rows unhashed (key 0: "changed" at the next trim).
        self.key = np.zeros(len(idx), dtype=np.uint64)
        self.check = np.zeros(len(idx), dtype=np.uint64)
        self.since = np.full(len(idx), now)
        self.raw = np.zeros(len(idx), dtype=bool)
        self._same: list[np.ndarray] = []
        self._encode: list[np.ndarray] = []
        self._zero: list[np.ndarray] = []

    def sort(self, chunks: Iterator[tuple[np.ndarray, np.ndarray]],
             scratch: Scratch | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Sort the (indices, pages) chunks of ``idx`` in order; yields those to encode
        (cold and zero), which ``encoded`` then names."""
        at = 0
        for part, pages in chunks:
            rows = slice(at, at + len(part))
            at += len(part)
            key, check = page_hashes(pages)
            self.key[rows], self.check[rows] = key, check
            in_use = in_sorted(part, self.faulted)
            same = self.entries_match(part, key, check) & ~in_use
            if self.prefetch_cold:
                self._same.append(part[same])
            self.since[rows], self.raw[rows] = self.history.look_up(part, key, self.now)
            zero = (key == ZERO_KEY) & (check == ZERO_CHECK)
            cold = ~same & ~in_use & ~self.raw[rows] & (self.now - self.since[rows] >= self.cold_after_s)
            encode = cold | zero
            if encode.any():
                self._encode.append(part[encode])
                self._zero.append(part[zero])
                yield without_rows(part, pages, ~encode, scratch)

    @property
    def same(self) -> np.ndarray:
        """Copies equal to their entries, to drop without encoding (ascending)."""
        return np.concatenate(self._same) if self._same else _EMPTY

    @property
    def encoded(self) -> np.ndarray:
        """Copies handed to the encoder, cold and zero (ascending)."""
        return np.concatenate(self._encode) if self._encode else _EMPTY

    @property
    def zero(self) -> np.ndarray:
        """Of those, the zero ones (ascending)."""
        return np.concatenate(self._zero) if self._zero else _EMPTY

    def keep_history(self, dropped: np.ndarray) -> None:
        """Note in the history what every copy not ``dropped`` looked like at this trim."""
        kept = ~in_sorted(self.idx, dropped)
        self.history.keep(self.idx[kept], self.key[kept], self.since[kept], self.raw[kept])
