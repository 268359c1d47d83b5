"""Content hashes of pages: XXH3-128, split into a 64-bit lookup key and a 64-bit checksum.

One hash call per page serves both purposes: the first half of the canonical XXH3-128 digest
(``key``) finds duplicates, the second half (``check``) is the checksum that every decoded page
is verified against. XXH3 is not collision-resistant against an adversary, so a duplicate found
by key is confirmed byte for byte before it is used (see encoder.py); the checksum guards
against corruption, not against a malicious guest.

Hashing is one C loop over the pages where _pagecodec.so is built (XXH3 of libxxhash, the same
digest; checked against python-xxhash when the library loads), else a per-page call into
xxhash's C code (~1 us per page with Python's share); it runs only on the pages that the
vectorised zero/template checks did not settle, and on the copies a compression checks for
change.
"""

from __future__ import annotations

import numpy as np
import xxhash

from azqemu.memory.kinds import PAGE_SIZE

_digest = xxhash.xxh3_128_digest


def _native() -> object | None:
    from azqemu.memory.zstdlib import _NATIVE, NATIVE_CHECKS

    return _NATIVE if NATIVE_CHECKS else None


def _native_hashes(lib: object, pages: np.ndarray, rows: np.ndarray | None, n: int) -> tuple[np.ndarray, np.ndarray]:
    key = np.empty(n, np.uint64)
    check = np.empty(n, np.uint64)
    r = None if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    lib.azq_page_hashes(n, pages.ctypes.data, None if r is None else r.ctypes.data,  # type: ignore[attr-defined]
                        key.ctypes.data, check.ctypes.data)
    return key, check


def page_hashes(pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key, check) uint64 arrays for an (n, 4096) uint8 page array."""
    n = len(pages)
    if n == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    pages = np.ascontiguousarray(pages)
    lib = _native()
    if lib is not None and pages.dtype == np.uint8 and pages.size == n * PAGE_SIZE:
        return _native_hashes(lib, pages, None, n)
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
    lib = _native()
    if lib is not None and pages.dtype == np.uint8 and pages.size == len(pages) * PAGE_SIZE:
        if len(rows) and (int(np.min(rows)) < 0 or int(np.max(rows)) >= len(pages)):
            raise IndexError("page row out of range")
        return _native_hashes(lib, pages, rows, n)
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
