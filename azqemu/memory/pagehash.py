"""Content hashes of pages: XXH3-128, split into a 64-bit lookup key and a 64-bit checksum.

One hash call per page serves both purposes: the first half of the canonical XXH3-128 digest
(``key``) finds duplicates, the second half (``check``) is the checksum that every decoded page
is verified against. XXH3 is not collision-resistant against an adversary, so a duplicate found
by key is confirmed byte for byte before it is used (see encoder.py); the checksum guards
against corruption, not against a malicious guest.

Hashing is a per-page call into xxhash's C code (~0.3 us per page here); it runs only on the
pages that the vectorised zero/template checks did not settle.
"""

from __future__ import annotations

import numpy as np
import xxhash

from azqemu.memory.kinds import PAGE_SIZE

_digest = xxhash.xxh3_128_digest


def page_hashes(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key, check) uint64 arrays for an (n, 4096) uint8 page array."""
    n = len(pages)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    pages = np.ascontiguousarray(pages)
    mv = pages.data.cast("B")
    raw = b"".join([_digest(mv[i * PAGE_SIZE:(i + 1) * PAGE_SIZE]) for i in range(n)])
    both = np.frombuffer(raw, dtype="<u8").reshape(n, 2)
    return both[:, 0].copy(), both[:, 1].copy()


def page_hashes_rows(pages: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key, check) of the selected rows of a C-contiguous page array, without copying them."""
    n = len(rows)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    if not pages.flags.c_contiguous:
        return page_hashes(pages[rows])
    mv = pages.data.cast("B")
    raw = b"".join([_digest(mv[r * PAGE_SIZE:(r + 1) * PAGE_SIZE]) for r in rows.tolist()])
    both = np.frombuffer(raw, dtype="<u8").reshape(n, 2)
    return both[:, 0].copy(), both[:, 1].copy()


def _buf(page: np.ndarray | bytes | memoryview) -> bytes | memoryview:
    return np.ascontiguousarray(page).data if isinstance(page, np.ndarray) else page


def page_hash(page: np.ndarray | bytes | memoryview) -> tuple[int, int]:
    d = _digest(_buf(page))
    return int.from_bytes(d[:8], "little"), int.from_bytes(d[8:], "little")


def page_checks(pages: np.ndarray) -> np.ndarray:
    """The checksum half only (used to verify decoded pages)."""
    return page_hashes(pages)[1]


ZERO_PAGE = np.zeros(PAGE_SIZE, dtype=np.uint8)
ZERO_PAGE.flags.writeable = False
ZERO_KEY, ZERO_CHECK = page_hash(ZERO_PAGE)
