"""LZ4 for single 4 KiB pages: the codec of hot pages, chosen for its decode speed.

A hot page (one the sandbox touched since its last resume) is put back before the vCPUs
continue, so its decode cost is on the resume's critical path. On this host zstd-1 decodes a
text-like page in ~5.6 us whatever the level (negative levels: ~4.1-4.9 us), LZ4 in ~1.2 us,
for ~35% more bytes (tests/perf/test_codec_perf.py, real guest text pages: zstd-1 3.32x, LZ4
2.10x). Payloads are raw LZ4 blocks (no frame, no size prefix: every payload is one page).

Backends: the system's liblz4.so.1 through ctypes (its functions are also handed to the C
loops of _pagecodec.c), else python-lz4's ``lz4.block``; both read and write the same block
format.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any

import lz4.block
import numpy as np

from azqemu.errors import StoreCorrupt
from azqemu.memory.kinds import PAGE_SIZE

# LZ4_compressBound(4096) = 4096 + 4096/255 + 16 = 4128; the scratch has the zstd bound's room.
BOUND_BYTES = PAGE_SIZE + 128
# LZ4 high-compression level of hot pages. Measured on real guest text pages (4 KiB blocks):
# fast mode 2.09x at ~6 us per page, HC 2 2.44x at ~25 us, HC 4 2.49x at ~31 us, HC 9 2.53x;
# decoding is as fast or faster for HC (~1.1 us). Level 2 takes most of the gain; encoding
# runs while the agent waits for its LLM, off the resume's path.
HOT_LZ4_LEVEL = 2


def _load() -> Any | None:
    if os.environ.get("AZQ_LZ4_BACKEND", "") == "python":
        return None
    name = ctypes.util.find_library("lz4") or "liblz4.so.1"
    try:
        lib = ctypes.CDLL(name)
        # lz4.h / lz4hc.h, stable API (v1.9): int f(const char*, char*, int, int), and
        # int LZ4_compress_HC_extStateHC(void*, const char*, char*, int, int, int).
        for fn in (lib.LZ4_compress_default, lib.LZ4_decompress_safe):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            fn.restype = ctypes.c_int
        lib.LZ4_compress_HC_extStateHC.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 3
        lib.LZ4_compress_HC_extStateHC.restype = ctypes.c_int
        lib.LZ4_sizeofStateHC.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


LIB = _load()
_TLS = threading.local()


def compress_addr(src_addr: int, level: int = HOT_LZ4_LEVEL) -> bytes:
    """LZ4 block of the page at ``src_addr`` (a C-contiguous page the caller keeps alive);
    ``level`` 0 is LZ4's fast mode, 1-12 its high-compression (HC) mode."""
    if LIB is None:
        data = ctypes.string_at(src_addr, PAGE_SIZE)
        if level > 0:
            return lz4.block.compress(data, mode="high_compression", compression=level, store_size=False)
        return lz4.block.compress(data, store_size=False)
    scratch = getattr(_TLS, "scratch", None)
    if scratch is None:
        scratch = _TLS.scratch = ctypes.create_string_buffer(BOUND_BYTES)
        _TLS.state = ctypes.create_string_buffer(LIB.LZ4_sizeofStateHC())
    if level > 0:
        n = LIB.LZ4_compress_HC_extStateHC(_TLS.state, src_addr, ctypes.addressof(scratch), PAGE_SIZE,
                                           BOUND_BYTES, level)
    else:
        n = LIB.LZ4_compress_default(src_addr, ctypes.addressof(scratch), PAGE_SIZE, BOUND_BYTES)
    if n <= 0:
        raise RuntimeError("LZ4_compress_default failed")
    return scratch.raw[:n]


def compress(page: np.ndarray, level: int = HOT_LZ4_LEVEL) -> bytes:
    p = np.ascontiguousarray(page, dtype=np.uint8)
    return compress_addr(p.ctypes.data, level)


def decompress_addr(payload: bytes, out_addr: int, what: str = "page") -> None:
    """Decode one page into the 4096 bytes at ``out_addr``; StoreCorrupt if it is not a page."""
    if LIB is not None:
        n = LIB.LZ4_decompress_safe(payload, out_addr, len(payload), PAGE_SIZE)
        if n != PAGE_SIZE:
            raise StoreCorrupt(what, "undecodable LZ4 block" if n < 0 else f"LZ4 block decodes to {n} bytes")
        return
    try:
        data = lz4.block.decompress(payload, uncompressed_size=PAGE_SIZE)
    except lz4.block.LZ4BlockError as err:
        raise StoreCorrupt(what, f"undecodable LZ4 block: {err}") from err
    if len(data) != PAGE_SIZE:
        raise StoreCorrupt(what, f"LZ4 block decodes to {len(data)} bytes")
    ctypes.memmove(out_addr, data, PAGE_SIZE)


def decompress_into(payload: bytes, out: np.ndarray, what: str = "page") -> None:
    decompress_addr(payload, out.ctypes.data, what)


def function_addresses() -> tuple[int, int, int, int]:
    """(LZ4_compress_default, LZ4_decompress_safe, LZ4_compress_HC_extStateHC, LZ4_sizeofStateHC())
    for the C loops, or zeros."""
    if LIB is None:
        return 0, 0, 0, 0
    addr = [ctypes.cast(f, ctypes.c_void_p).value or 0
            for f in (LIB.LZ4_compress_default, LIB.LZ4_decompress_safe, LIB.LZ4_compress_HC_extStateHC)]
    return addr[0], addr[1], addr[2], int(LIB.LZ4_sizeofStateHC())
