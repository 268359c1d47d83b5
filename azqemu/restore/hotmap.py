"""A fault handler's hot marks for one RAM block: the pages faulted since the last phase.

A bit per page (LSB first), in two maps alternated at each phase and never reallocated: the
native fault thread holds the current map's address (a fresh map per phase, kept alive for
it, had grown the manager by a map per sandbox per phase). Marks are predictions, not data:
a mark lost to a race (the Python thread and the C thread setting bits of one byte; a late
mark landing in the map just retired) is a page not prefetched, or prefetched once more.
"""

from __future__ import annotations

import numpy as np


class HotMaps:
    __slots__ = ("current", "spare", "pages")

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.current = bytearray((pages + 7) // 8)
        self.spare = bytearray(len(self.current))

    def mark(self, i: int) -> None:
        self.current[i >> 3] |= 1 << (i & 7)

    def indices(self) -> np.ndarray:
        """Marked pages. The fault threads may mark while this runs: read a snapshot."""
        bits = np.unpackbits(np.frombuffer(bytes(self.current), dtype=np.uint8), bitorder="little")
        return np.flatnonzero(bits[:self.pages])

    def swap(self) -> bytearray:
        """Start a phase: the spare map, cleared, becomes the current one (returned)."""
        np.frombuffer(self.spare, dtype=np.uint8).fill(0)
        self.current, self.spare = self.spare, self.current
        return self.current

    @property
    def nbytes(self) -> int:
        return 2 * len(self.current)
