"""Reading the pages a sandbox holds of its own, in bounded chunks.

A copy-on-write clone's own pages are the anonymous copies in QEMU's private mapping of the
template image (told apart through /proc/PID/pagemap, read with process_vm_readv); a lazy or
eager clone's are the data extents of its RAM memfd (read with preadv). Compress and trim
read them ``CHUNK_PAGES`` at a time, so the manager never holds more of a sandbox's bytes than
that whatever the sandbox holds (the encoder's work buffers follow the chunk, too).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from azqemu.host.pagemap import private_pages, read_pages
from azqemu.memory.pagehash import page_hashes
from azqemu.memory.ram import read_file_pages, resident_page_index
from azqemu.memory.zstdlib import compact_rows
from azqemu.pages import PAGE_SIZE, Scratch, scratch_rows, take_rows

# 8 MiB: the read buffer, compacted in place (without_rows), and the encoder's work buffers
# (three page arrays of 128 unique pages, the batch codec's output, whatever the chunk) are what a
# compression holds above idle: ~13 MiB at this size against ~6 MiB at 512 pages
# (tests/unit/daemon/test_ramscan_memory.py), and ~25 MiB when the encoder's buffers grew with
# the chunk too. Each chunk costs a pass of a dozen steps in Python and numpy whatever its size
# (hashes, checks against the entries, a PageStore.encode call with its plan and commit): a
# coding-agent compression of ~2,950 copies took a median 14% less CPU in 2 chunks than in 6
# (one sandbox's compress/resume cycles, 2048 against 512 pages, five pairs: -20% to +2%;
# session 41). A commit holds the store's lock ~1.6 ms for 2,048 pages against ~0.8 ms for
# 512, in a third as many takes.
CHUNK_PAGES = 2048


def without_rows(part: np.ndarray, pages: np.ndarray, drop: np.ndarray,
                 scratch: Scratch | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``part`` and ``pages`` less the rows where ``drop`` is true. Without ``scratch``, new
    arrays. With it, ``pages`` is a work buffer itself (``RamScan.chunks``' rows, valid until
    the next chunk): the pages kept move up within it, in place (C), or where _pagecodec.so is
    not built go into the scratch buffer "kept". In place, no second 8 MiB buffer is filled:
    fresh memory costs a page fault per page on its first write (pages.py)."""
    keep = ~drop
    if scratch is None:
        return part[keep], pages[keep]
    rows = np.flatnonzero(keep)
    moved = compact_rows(pages, rows)
    if moved is not None:
        return part[keep], moved
    return part[keep], take_rows(pages, rows, scratch_rows(scratch, "kept", len(rows)))


@dataclass(frozen=True)
class RamScan:
    pid: int              # QEMU (copy-on-write: the mapping's process)
    hva: int              # where the guest RAM block is mapped in QEMU
    page_count: int
    ram_fd: int           # the RAM memfd (lazy and eager clones), -1 for copy-on-write
    cow: bool

    def index(self) -> np.ndarray:
        """The pages held of the sandbox's own (sorted): copies, or the memfd's data."""
        if self.cow:
            return private_pages(self.pid, self.hva, self.page_count)
        idx = resident_page_index(self.ram_fd)
        return idx[idx < self.page_count]

    def chunks(self, idx: np.ndarray, scratch: Scratch | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(indices, pages) of ``idx``, CHUNK_PAGES at a time; with ``scratch``, copy-on-write
        pages are read into its buffer, valid until the next chunk is asked for."""
        for start in range(0, len(idx), CHUNK_PAGES):
            part = idx[start:start + CHUNK_PAGES]
            if self.cow:
                out = None if scratch is None else scratch_rows(scratch, "read", CHUNK_PAGES)
                yield part, read_pages(self.pid, self.hva, part, out)
            else:
                yield part, read_file_pages(self.ram_fd, part)

    def unchanged(self, idx: np.ndarray, key: np.ndarray, check: np.ndarray,
                  scratch: Scratch | None = None) -> np.ndarray:
        """Whether each page of ``idx`` still hashes (XXH3-128) to its ``key`` and ``check``:
        read again, so that pages classified while the guest ran are dropped only if the guest
        (paused now) did not write them since."""
        same = np.zeros(len(idx), dtype=bool)
        at = 0
        for part, pages in self.chunks(idx, scratch):
            k, c = page_hashes(pages)
            rows = slice(at, at + len(part))
            same[rows] = (k == key[rows]) & (c == check[rows])
            at += len(part)
        return same

    def resident_bytes(self) -> int:
        """Guest RAM held for this sandbox alone."""
        if self.cow:
            return len(private_pages(self.pid, self.hva, self.page_count)) * PAGE_SIZE
        return os.fstat(self.ram_fd).st_blocks * 512
