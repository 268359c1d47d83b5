"""Decoding blobs: copying their payloads out under the store's lock, decoding outside it.

A blob is decoded from a *recipe* (one blob: the single-page fault path and the encoder's DUP
confirmations) or a *batch* (many blobs: bulk decode for prefetch). Recipes and batches are
read from the blob table and the arenas while the store's lock is held, and hold copies of
the payloads, so decoding runs without the lock and a concurrent free or compaction cannot
pull the bytes away. SDELTA bases come along (chains are one deep) and are decoded and verified
before the pages that depend on them. Every decoded page is checked against its checksum; a
ChecksumMismatch raised here carries the failing blob in ``blob_id`` and the store maps it to a
page.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import xxhash

from azqemu.errors import ChecksumMismatch, StoreCorrupt
from azqemu.host.threads import run_at_nice, thread_nice
from azqemu.memory import lz4page, pagepatch
from azqemu.memory.arena import ArenaSet
from azqemu.memory.blobtable import BlobTable
from azqemu.memory.kinds import PAGE_SIZE, Method, RefType
from azqemu.memory.pagehash import page_hashes_rows
from azqemu.memory.template import TemplateImage
from azqemu.memory.zstdlib import NATIVE_CHECKS, PageZstd

_DIGEST = xxhash.xxh3_128_digest
_ZERO_ARRAY = np.zeros(PAGE_SIZE, dtype=np.uint8)
_ZERO_ARRAY.flags.writeable = False
_REFTYPE_BLOB, _REFTYPE_TEMPLATE = int(RefType.BLOB), int(RefType.TEMPLATE)
_M_ZSTD, _M_XOR, _M_PREFIX, _M_LZ4 = int(Method.ZSTD), int(Method.XOR), int(Method.PREFIX), int(Method.LZ4)
_M_LZ4_XOR, _M_PATCH = int(Method.LZ4_XOR), int(Method.PATCH)
_TLS = threading.local()
T = TypeVar("T")
# Bulk decodes of at least this many blobs are split in two halves decoded at once, one in a
# helper thread (the C loop releases the GIL). Above the prefetcher's chunk (1024 pages) on
# purpose: the prefetcher already decodes chunk k+1 in a helper while it copies chunk k, and a
# third busy thread on a 2-core host only slowed the copies (in-process 100 MiB hot prefetch:
# 0.080-0.094 s split, 0.074-0.085 s not). Large one-shot decodes (analysis, tests) still
# split; below ~512 blobs the hand-off (~50-100 us) costs more than it saves anyway.
SPLIT_MIN_BLOBS = 2048
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="azq-decode")
        return _POOL


@dataclass
class Recipe:
    """Everything needed to decode one blob outside the lock."""

    blob: int
    payload: bytes
    method: int
    reftype: int
    ref: int
    check: int
    base: Recipe | None = None


@dataclass
class Batch:
    """Many blobs at once: their fields as arrays and their payloads back to back."""

    blobs: np.ndarray
    payload: bytes | np.ndarray   # uint8 array when gathered by the C loop
    off: np.ndarray          # u32 offset of each payload in ``payload``
    length: np.ndarray       # u32
    method: np.ndarray       # u8
    reftype: np.ndarray      # u8
    ref: np.ndarray          # int64
    check: np.ndarray        # u64
    base: Batch | None = None
    base_pos: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))   # row in base, -1


def read_recipe(table: BlobTable, arenas: ArenaSet, blob: int, depth: int = 0) -> Recipe:
    """Under the store's lock: copy a blob's payload and fields (and its base's) for decoding."""
    where = str(arenas.root)
    if not 0 <= blob < table.n:
        raise StoreCorrupt(where, f"blob {blob} out of range")
    key, check, offset, ref, refcount, arena, length, _dom, method, reftype = table.rows[blob].item()
    if refcount == 0:
        raise StoreCorrupt(where, f"reference to freed blob {blob}")
    payload = arenas.read(arena, offset, length)
    base = None
    if reftype == _REFTYPE_BLOB:
        if depth:
            raise StoreCorrupt(where, f"blob {blob}: SDELTA chain deeper than one")
        base = read_recipe(table, arenas, ref, depth + 1)
    return Recipe(blob, payload, method, reftype, ref, check, base)


def decode_recipe(zstd: PageZstd, r: Recipe, out: np.ndarray, template: TemplateImage, out_addr: int = 0) -> None:
    """Decode one blob into ``out`` (a 4096-byte C-contiguous array) and verify it.

    ``out_addr`` (the address of ``out``, when the caller has it cached) lets the libzstd
    backend skip numpy's ctypes bridge, ~1.4 us of a ~10 us fault here.
    """
    ref_page: np.ndarray = _ZERO_ARRAY
    ref_addr = 0
    if r.reftype == _REFTYPE_TEMPLATE:
        row = template.row(r.ref)
        row = template.zero_row if row < 0 else row
        ref_page = template.pages_z[row]
        ref_addr = template.pages_z_addr + row * PAGE_SIZE
    elif r.reftype == _REFTYPE_BLOB:
        assert r.base is not None
        ref_page, ref_addr = _scratch()
        decode_recipe(zstd, r.base, ref_page, template, ref_addr)
    what = f"blob {r.blob}"
    if r.method == _M_PATCH:
        if zstd.native is not None:
            zstd.patch_apply_addr(r.payload, 0 if r.reftype == RefType.NONE else (ref_addr or ref_page.ctypes.data),
                                  out_addr or out.ctypes.data, what)
        else:
            pagepatch.apply_patch(r.payload, None if r.reftype == RefType.NONE else ref_page, out, what)
    elif r.method == _M_LZ4 or r.method == _M_LZ4_XOR:
        lz4page.decompress_addr(r.payload, out_addr or out.ctypes.data, what)
        if r.method == _M_LZ4_XOR:
            if r.reftype == RefType.NONE:
                raise StoreCorrupt(what, "LZ4_XOR blob without a reference")
            np.bitwise_xor(out, ref_page, out=out)
    elif out_addr and zstd.backend == "libzstd":
        zstd.decompress_addr(r.payload, out_addr, ref_addr if r.method == _M_PREFIX else 0, what)
        if r.method == _M_XOR:
            np.bitwise_xor(out, ref_page, out=out)
        elif r.method > _M_PREFIX:
            raise StoreCorrupt(f"blob {r.blob}", f"unknown method {r.method}")
    elif r.method == _M_ZSTD:
        zstd.decompress_into(r.payload, out, None, what)
    elif r.method == _M_PREFIX:
        zstd.decompress_into(r.payload, out, ref_page, what)
    elif r.method == _M_XOR:
        zstd.decompress_into(r.payload, out, None, what)
        np.bitwise_xor(out, ref_page, out=out)
    else:
        raise StoreCorrupt(f"blob {r.blob}", f"unknown method {r.method}")
    if int.from_bytes(_DIGEST(out.data)[8:], "little") != r.check:
        raise ChecksumMismatch(-1, f"blob {r.blob}")

def _scratch() -> tuple[np.ndarray, int]:
    """A per-thread page (and its address) for SDELTA bases on the single-page path."""
    pair = getattr(_TLS, "base", None)
    if pair is None:
        buf = np.empty(PAGE_SIZE, dtype=np.uint8)
        pair = _TLS.base = (buf, buf.ctypes.data)
    return pair


def read_batch(table: BlobTable, arenas: ArenaSet, blobs: np.ndarray, depth: int = 0) -> Batch:
    """Under the store's lock: the fields and payloads of many blobs (and of their SDELTA bases)."""
    where = str(arenas.root)
    blobs = np.asarray(blobs, dtype=np.int64)
    if len(blobs) and (blobs.min() < 0 or blobs.max() >= table.n):
        raise StoreCorrupt(where, "blob id out of range")
    rows = table.rows[blobs]
    if (rows["refcount"] == 0).any():
        raise StoreCorrupt(where, "reference to a freed blob")
    length = rows["length"].astype(np.uint32)
    payload = arenas.gather(rows["arena"], rows["offset"], length)
    off = (np.cumsum(length, dtype=np.uint64) - length).astype(np.uint32)
    batch = Batch(blobs, payload, off, length, rows["method"].copy(), rows["reftype"].copy(),
                   rows["ref"].astype(np.int64), rows["check"].copy())
    based = np.flatnonzero(batch.reftype == _REFTYPE_BLOB)
    if len(based):
        if depth:
            raise StoreCorrupt(where, "SDELTA chain deeper than one")
        base_ids, pos = np.unique(batch.ref[based], return_inverse=True)
        batch.base = read_batch(table, arenas, base_ids, depth + 1)
        batch.base_pos = np.full(len(blobs), -1, dtype=np.int64)
        batch.base_pos[based] = pos
    return batch


def decode_batch(zstd: PageZstd, b: Batch, template: TemplateImage, out: np.ndarray | None = None,
                 rows: np.ndarray | None = None) -> np.ndarray:
    """Decode a batch into ``out[rows]`` (default: a new (k, 4096) array) and verify it.

    SDELTA bases are decoded (and verified) first, once each; the per-page loop runs in C
    when _pagecodec.so is built, else in Python; checksums are verified here either way.
    """
    k = len(b.blobs)
    if out is None:
        out = np.empty((k, PAGE_SIZE), dtype=np.uint8)
        rows = np.arange(k, dtype=np.int64)
    assert rows is not None
    bases = decode_batch(zstd, b.base, template) if b.base is not None else None
    # Reference page of each payload: a template row (holes: the zero row) or a decoded base.
    ref_arr: list[np.ndarray | None] = [None] * k
    tsel = b.reftype == _REFTYPE_TEMPLATE
    trow = np.zeros(k, dtype=np.int64)
    if tsel.any():
        trow[tsel] = template.rows_z(b.ref[tsel])
    z = zstd
    if z.native is not None:
        ref_addr = np.zeros(k, dtype=np.uint64)
        ref_addr[tsel] = template.pages_z.ctypes.data + trow[tsel] * PAGE_SIZE
        if bases is not None:
            bsel = b.base_pos >= 0
            ref_addr[bsel] = bases.ctypes.data + b.base_pos[bsel] * PAGE_SIZE
        check = b.check if NATIVE_CHECKS else None
        bad = _native_decode(z, b, ref_addr, out, rows, check)
        if bad < -1:
            _mismatch(int(b.blobs[-bad - 2]))
        if bad >= 0:
            raise StoreCorrupt(f"blob {int(b.blobs[bad])}", "not a valid page frame")
        if check is not None:
            return out
    else:
        for i in np.flatnonzero(tsel).tolist():
            ref_arr[i] = template.pages_z[trow[i]]
        if bases is not None:
            for i in np.flatnonzero(b.base_pos >= 0).tolist():
                ref_arr[i] = bases[b.base_pos[i]]
        payload = b.payload
        for i, (o, n, mth, dst) in enumerate(zip(b.off.tolist(), b.length.tolist(), b.method.tolist(),
                                                rows.tolist())):
            what = f"blob {int(b.blobs[i])}"
            frame = bytes(payload[o:o + n])
            if mth == _M_PATCH:
                pagepatch.apply_patch(frame, ref_arr[i], out[dst], what)
            elif mth == _M_PREFIX:
                z.decompress_into(frame, out[dst], ref_arr[i], what)
            elif mth == _M_LZ4 or mth == _M_LZ4_XOR:
                lz4page.decompress_into(frame, out[dst], what)
                if mth == _M_LZ4_XOR:
                    ra = ref_arr[i]
                    if ra is None:
                        raise StoreCorrupt(what, "LZ4_XOR blob without a reference")
                    np.bitwise_xor(out[dst], ra, out=out[dst])
            elif mth == _M_ZSTD or mth == _M_XOR:
                z.decompress_into(frame, out[dst], None, what)
                if mth == _M_XOR:
                    ra = ref_arr[i]
                    assert ra is not None
                    np.bitwise_xor(out[dst], ra, out=out[dst])
            else:
                raise StoreCorrupt(what, f"unknown method {mth}")
    bad_rows = page_hashes_rows(out, rows)[1] != b.check
    if bad_rows.any():
        _mismatch(int(b.blobs[int(np.flatnonzero(bad_rows)[0])]))
    return out


def _mismatch(blob_id: int) -> None:
    err = ChecksumMismatch(-1, f"blob {blob_id}")
    err.blob_id = blob_id       # type: ignore[attr-defined]
    raise err


def _native_decode(z: PageZstd, b: Batch, ref_addr: np.ndarray, out: np.ndarray, rows: np.ndarray,
                   check: np.ndarray | None) -> int:
    """The C loop over the batch, in two halves at once when it is large (see SPLIT_MIN_BLOBS).
    Returns the C loop's code for the whole batch (indices are batch-wide)."""
    k = len(b.blobs)
    if k < SPLIT_MIN_BLOBS:
        return z.decode_batch(b.payload, b.off, b.length, b.method, ref_addr, out, rows, check)
    h = k // 2

    def half(s: int, e: int) -> int:
        code = z.decode_batch(b.payload, b.off[s:e], b.length[s:e], b.method[s:e], ref_addr[s:e], out,
                              rows[s:e], None if check is None else check[s:e])
        return code if code == -1 else (code + s if code >= 0 else code - s)

    fut: Future[int] = _pool().submit(run_at_nice, thread_nice(), half, h, k)
    first = half(0, h)
    second = fut.result()
    # Report the first failing blob in batch order.
    return first if first != -1 else second

