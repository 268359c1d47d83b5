"""PATCH payloads: a page as the few byte runs where it differs from its reference.

A page written in place by a few bytes (reference counts of a walked heap, a flag, a counter,
a pointer) differs from the template page at the same address, or from a sibling's blob, in a
handful of bytes. zstd of the XOR delta costs 4-9 us per attempt here and still spends a frame
header on it; a list of the changed byte runs takes ~1 us to build, 0.3 us to apply, and on
such pages is smaller (measured on the copies of a walked Python heap and of a coding agent's
guest: half of the XOR candidates give a patch of at most 64 bytes, 40-60% smaller than zstd
of the XOR on those pages).

Payload format, runs in increasing offset order, none overlapping:
    repeat { u16 little-endian offset; u8 length - 1; length bytes of the page }
The page is the reference (the zero page when there is none) with each run copied over it.
Changed bytes at most ``GAP_MERGE_BYTES`` apart share a run (a gap of g unchanged bytes costs
g bytes inside a run, a new run 3). A patch larger than the cap is not made: zstd wins there.

The encoder's C loop (_pagecodec.c patch_make / patch_apply, _storeview.c) follows this file
byte for byte; this is the reference and the fallback where the library is not built.
"""

from __future__ import annotations

import numpy as np

from azqemu.errors import StoreCorrupt
from azqemu.memory.kinds import PAGE_SIZE

RUN_HEADER_BYTES = 3
GAP_MERGE_BYTES = 3
# A patch larger than this is not made (every run then fits the u8 length: 3 + 253 bytes).
PATCH_MAX_BYTES = 256
MAX_RUN_BYTES = 256        # what a run's u8 length - 1 can say


def make_patch(page: np.ndarray, xor: np.ndarray, cap: int = PATCH_MAX_BYTES) -> bytes | None:
    """The patch that turns the reference into ``page`` (``xor``: page XOR reference, both 4096
    uint8), or None when the two are equal or the patch would exceed ``cap`` bytes."""
    nz = np.flatnonzero(xor)
    if len(nz) == 0 or len(nz) + RUN_HEADER_BYTES > cap:
        return None
    breaks = np.flatnonzero(np.diff(nz) > GAP_MERGE_BYTES + 1)
    starts = np.concatenate((nz[:1], nz[breaks + 1]))
    ends = np.concatenate((nz[breaks], nz[-1:])) + 1
    lengths = ends - starts
    if RUN_HEADER_BYTES * len(starts) + int(lengths.sum()) > cap or int(lengths.max()) > MAX_RUN_BYTES:
        return None
    out = bytearray()
    data = page.tobytes() if isinstance(page, np.ndarray) else bytes(page)
    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        out += s.to_bytes(2, "little") + (n - 1).to_bytes(1, "little") + data[s:s + n]
    return bytes(out)


def apply_patch(payload: bytes, ref: np.ndarray | None, out: np.ndarray, what: str) -> None:
    """out = ``ref`` (the zero page if None) with the payload's runs copied over it. A payload
    that is not a well-formed patch raises StoreCorrupt (runs out of the page, out of order,
    cut short); the caller still checks the page against its checksum."""
    if ref is None:
        out[:] = 0
    else:
        out[:] = ref
    pos, end, n = 0, 0, len(payload)
    if n == 0:
        raise StoreCorrupt(what, "empty PATCH payload")
    while pos < n:
        if n - pos < RUN_HEADER_BYTES:
            raise StoreCorrupt(what, "PATCH run header cut short")
        off = payload[pos] | (payload[pos + 1] << 8)
        length = payload[pos + 2] + 1
        pos += RUN_HEADER_BYTES
        if off < end or off + length > PAGE_SIZE or n - pos < length:
            raise StoreCorrupt(what, f"PATCH run at {off} (+{length}) out of place")
        out[off:off + length] = np.frombuffer(payload, dtype=np.uint8, count=length, offset=pos)
        pos += length
        end = off + length
