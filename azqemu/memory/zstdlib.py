"""zstd for single 4 KiB pages, with and without a reference page as raw-content prefix.

Two interchangeable backends produce and read the same frames (zstd format, RFC 8878, in its
magicless variant: every payload is a page, so the 4-byte magic is dead weight):

- ``libzstd`` through ctypes (the system's libzstd.so.1, stable ABI >= 1.4): it can reference
  a prefix without building a dictionary object (``ZSTD_CCtx_refPrefix`` /
  ``ZSTD_DCtx_refPrefix``), which is 2-3x cheaper per page than python-zstandard's dictionary
  path, and it decompresses straight into the caller's buffer;
- ``python-zstandard`` (the fallback when libzstd.so.1 cannot be loaded), with
  ``DICT_TYPE_RAWCONTENT`` passed explicitly so that a reference page that happens to begin
  with the dictionary magic 0xEC30A437 is still taken as raw content.

A prefix and a raw-content dictionary are the same thing in the zstd format, so frames made by
one backend decode with the other (a unit test checks it). Contexts are per thread: zstd
contexts are not thread-safe, and the decode path runs in a fault-handler thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from typing import Any

import numpy as np
import zstandard

from azqemu.errors import StoreCorrupt
from azqemu.memory.kinds import PAGE_SIZE

DEFAULT_LEVEL = 1
# Worst-case frame size of one page (ZSTD_compressBound(4096) = 4096 + 4096/256 + 64 slack).
BOUND_BYTES = PAGE_SIZE + 128

# zstd.h parameter numbers (stable ABI of ZSTD_CCtx_setParameter / ZSTD_DCtx_setParameter).
_ZSTD_c_compressionLevel = 100
_ZSTD_c_contentSizeFlag = 200
_ZSTD_c_checksumFlag = 201
_ZSTD_c_dictIDFlag = 202
_ZSTD_c_format = 10            # ZSTD_c_experimentalParam2: accepted by the shared library
_ZSTD_d_format = 1000          # ZSTD_d_experimentalParam1
_ZSTD_f_zstd1_magicless = 1

_V, _S, _I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int


def _load_libzstd() -> Any | None:
    if os.environ.get("AZQ_ZSTD_BACKEND", "") == "python":
        return None
    name = ctypes.util.find_library("zstd") or "libzstd.so.1"
    try:
        lib = ctypes.CDLL(name)
        # Declarations follow zstd.h (v1.4+ stable section); a wrong signature would corrupt
        # the stack silently, so each one is spelled out.
        lib.ZSTD_versionNumber.restype = ctypes.c_uint
        if lib.ZSTD_versionNumber() < 10400:
            return None
        lib.ZSTD_createCCtx.restype = _V
        lib.ZSTD_createDCtx.restype = _V
        lib.ZSTD_freeCCtx.argtypes = [_V]
        lib.ZSTD_freeDCtx.argtypes = [_V]
        lib.ZSTD_CCtx_setParameter.argtypes = [_V, _I, _I]
        lib.ZSTD_CCtx_setParameter.restype = _S
        lib.ZSTD_DCtx_setParameter.argtypes = [_V, _I, _I]
        lib.ZSTD_DCtx_setParameter.restype = _S
        lib.ZSTD_CCtx_refPrefix.argtypes = [_V, _V, _S]
        lib.ZSTD_CCtx_refPrefix.restype = _S
        lib.ZSTD_DCtx_refPrefix.argtypes = [_V, _V, _S]
        lib.ZSTD_DCtx_refPrefix.restype = _S
        lib.ZSTD_compress2.argtypes = [_V, _V, _S, _V, _S]
        lib.ZSTD_compress2.restype = _S
        lib.ZSTD_decompressDCtx.argtypes = [_V, _V, _S, _V, _S]
        lib.ZSTD_decompressDCtx.restype = _S
        lib.ZSTD_CCtx_reset.argtypes = [_V, _I]
        lib.ZSTD_CCtx_reset.restype = _S
        lib.ZSTD_DCtx_reset.argtypes = [_V, _I]
        lib.ZSTD_DCtx_reset.restype = _S
        lib.ZSTD_isError.argtypes = [_S]
        lib.ZSTD_isError.restype = ctypes.c_uint
        return lib
    except (OSError, AttributeError):
        return None


_LIB = _load_libzstd()

# The optional C loops (_pagecodec.c, built by the Makefile). Flags and choices mirror the C enums.
F_XOR_T, F_PREFIX_T, F_XOR_S, F_PREFIX_S, F_HAS_S, F_LZ4, F_PATCH = 1, 2, 4, 8, 16, 32, 64
(C_ZSTD, C_XOR_T, C_PREFIX_T, C_XOR_S, C_PREFIX_S, C_LZ4, C_LZ4_XOR_T, C_LZ4_XOR_S, C_PATCH_T, C_PATCH_S,
 C_RAW) = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 255
NATIVE_ABI = 11
# The encoder's follow-up attempts whose odds the caller sets (A_* of _pagecodec.c: plain zstd
# after the XOR, the template prefix after the XOR or alone, the SDELTA pair), each in four
# buckets of the best payload so far (<= 512, 1024, 2048 bytes, more).
ATTEMPTS = ("plain", "prefix_after_xor", "prefix", "sdelta")
ATTEMPT_BUCKET_BYTES = (512, 1024, 2048)
ATTEMPT_SLOTS = len(ATTEMPTS) * (len(ATTEMPT_BUCKET_BYTES) + 1)


def _ptr(a: np.ndarray | None, dtype: type, n: int) -> int | None:
    """The address of a C-contiguous array of ``n`` ``dtype`` (None for None)."""
    if a is None:
        return None
    if a.dtype != dtype or not a.flags.c_contiguous or a.size < n:
        raise ValueError(f"need a contiguous {np.dtype(dtype).name} array of {n}")
    return int(a.ctypes.data)


def _xxh3_128_address() -> int:
    """XXH3_128bits of the system's libxxhash.so.0 (the C loops verify pages with it), or 0."""
    name = ctypes.util.find_library("xxhash") or "libxxhash.so.0"
    try:
        lib = ctypes.CDLL(name)
        return ctypes.cast(lib.XXH3_128bits, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):
        return 0


_HELPERS = 0       # what azq_set_helpers reported: 1 LZ4, 2 XXH3, 4 LZ4 HC


def _load_native() -> Any | None:
    if _LIB is None or os.environ.get("AZQ_NATIVE", "1") == "0":
        return None
    path = os.environ.get("AZQ_PAGECODEC_LIB") or os.path.join(os.path.dirname(__file__), "_pagecodec.so")
    if not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.azq_pagecodec_abi.restype = _I
        if lib.azq_pagecodec_abi() != NATIVE_ABI:
            return None
        lib.azq_encode_batch.restype = ctypes.c_long
        lib.azq_encode_batch.argtypes = [_V, _I, _V, _V, _V, _V, _V, _V, ctypes.c_long, ctypes.c_long,
                                         ctypes.c_long, ctypes.c_long, _I, _V, _S, _V, _V, _V, _V, _V, _V,
                                         ctypes.c_uint32]
        lib.azq_decode_batch.restype = ctypes.c_long
        lib.azq_decode_batch.argtypes = [_V, _I, _V, _V, _V, _V, _V, _V, _V, _V]
        lib.azq_page_checks.restype = _I
        lib.azq_page_checks.argtypes = [_I, _V, _V, _V]
        lib.azq_patch_apply.restype = _I
        lib.azq_patch_apply.argtypes = [_V, ctypes.c_uint32, _V, _V]
        lib.azq_page_hashes.restype = _I
        lib.azq_page_hashes.argtypes = [ctypes.c_long, _V, _V, _V, _V]
        lib.azq_classify.restype = _I
        lib.azq_classify.argtypes = [ctypes.c_long, _V, _V, _V, ctypes.c_long, _V, _I, _I]
        lib.azq_rows_equal.restype = _I
        lib.azq_rows_equal.argtypes = [ctypes.c_long, _V, _V, ctypes.c_long, _V, _V, ctypes.c_long, _V]
        lib.azq_compact_rows.restype = _I
        lib.azq_compact_rows.argtypes = [_V, ctypes.c_long, _V, ctypes.c_long]
        lib.azq_gather.restype = None
        lib.azq_gather.argtypes = [_I, _V, _V, _V]
        lib.azq_background_nice.restype = None
        lib.azq_background_nice.argtypes = [_I, _I]
        lib.azq_background_cpu_ns.restype = ctypes.c_uint64
        lib.azq_background_cpu_ns.argtypes = []
        lib.azq_sample_fingerprints.restype = None
        lib.azq_sample_fingerprints.argtypes = [ctypes.c_long, _V, _I, _V, _V, _V, _V]
        lib.azq_sim_hits.restype = None
        lib.azq_sim_hits.argtypes = [ctypes.c_long, _I, _V, ctypes.c_long, _V, _V, _I, _V, _I, _V, _V]
        lib.azq_best_candidates.restype = None
        lib.azq_best_candidates.argtypes = [ctypes.c_long, _I, _V, _V, _V]
        lib.azq_set_helpers.restype = _I
        lib.azq_set_helpers.argtypes = [_V, _V, _V, _I, _V]
        from azqemu.memory import lz4page

        lz4c, lz4d, lz4hc, hc_bytes = lz4page.function_addresses()
        xxh = _xxh3_128_address()
        global _HELPERS
        _HELPERS = lib.azq_set_helpers(lz4c or None, lz4d or None, lz4hc or None, hc_bytes, xxh or None)
        # The C checksum must be the store's checksum (pagehash.py): checked once here.
        if _HELPERS & 2 and not _native_checks_agree(lib):
            _HELPERS = lib.azq_set_helpers(lz4c or None, lz4d or None, lz4hc or None, hc_bytes, None)
        return lib
    except (OSError, AttributeError):
        return None


def _native_checks_agree(lib: Any) -> bool:
    import xxhash

    page = np.frombuffer(bytes(range(256)) * 16, dtype=np.uint8).copy()
    got = np.zeros(1, dtype=np.uint64)
    row = np.zeros(1, dtype=np.int64)
    lib.azq_page_checks(1, page.ctypes.data, row.ctypes.data, got.ctypes.data)
    return int(got[0]) == int.from_bytes(xxhash.xxh3_128_digest(page.data)[8:], "little")


_NATIVE = _load_native()
# What the C loops can do beyond zstd: LZ4 pages (bit 1), verify checksums (bit 2).
NATIVE_LZ4 = bool(_NATIVE is not None and (_HELPERS & 5) == 5)
NATIVE_CHECKS = bool(_NATIVE is not None and _HELPERS & 2)


class _CtxPair:
    """One compression and one decompression context of libzstd (freed with the object)."""

    def __init__(self, lib: Any, level: int) -> None:
        self.lib = lib
        self.cctx = lib.ZSTD_createCCtx()
        self.dctx = lib.ZSTD_createDCtx()
        if not self.cctx or not self.dctx:
            raise MemoryError("libzstd could not allocate a context")
        for param, value in ((_ZSTD_c_compressionLevel, level), (_ZSTD_c_contentSizeFlag, 1),
                             (_ZSTD_c_checksumFlag, 0), (_ZSTD_c_dictIDFlag, 0),
                             (_ZSTD_c_format, _ZSTD_f_zstd1_magicless)):
            if lib.ZSTD_isError(lib.ZSTD_CCtx_setParameter(self.cctx, param, value)):
                raise RuntimeError(f"libzstd refused compression parameter {param}")
        if lib.ZSTD_isError(lib.ZSTD_DCtx_setParameter(self.dctx, _ZSTD_d_format, _ZSTD_f_zstd1_magicless)):
            raise RuntimeError("libzstd refused the magicless format")
        self.scratch = ctypes.create_string_buffer(BOUND_BYTES)
        self.scratch_addr = ctypes.addressof(self.scratch)

    def __del__(self) -> None:
        try:
            self.lib.ZSTD_freeCCtx(self.cctx)
            self.lib.ZSTD_freeDCtx(self.dctx)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class PageZstd:
    """Compress and decompress single pages; thread-safe (per-thread contexts)."""

    def __init__(self, level: int = DEFAULT_LEVEL, backend: str | None = None) -> None:
        if not 1 <= level <= 19:
            raise ValueError("zstd level must be 1..19")
        self.level = level
        if backend is None:
            backend = "libzstd" if _LIB is not None else "python"
        if backend == "libzstd" and _LIB is None:
            raise RuntimeError("libzstd.so.1 is not available")
        self.backend = backend
        # The C loops share libzstd's contexts, so they come with the libzstd backend only.
        self.native = _NATIVE if backend == "libzstd" else None
        self._tls = threading.local()
        self._params = zstandard.ZstdCompressionParameters.from_level(
            level, source_size=PAGE_SIZE, format=zstandard.FORMAT_ZSTD1_MAGICLESS,
            write_content_size=1, write_checksum=0, write_dict_id=0)

    # -- per-thread state -------------------------------------------------------------
    def _ctx(self) -> _CtxPair:
        ctx = getattr(self._tls, "ctx", None)
        if ctx is None:
            ctx = self._tls.ctx = _CtxPair(_LIB, self.level)
        return ctx

    def _py(self) -> tuple[Any, Any]:
        pair = getattr(self._tls, "py", None)
        if pair is None:
            pair = self._tls.py = (zstandard.ZstdCompressor(compression_params=self._params),
                                   zstandard.ZstdDecompressor(format=zstandard.FORMAT_ZSTD1_MAGICLESS))
        return pair

    # -- compression --------------------------------------------------------------------
    def compress_addr(self, src_addr: int, ref_addr: int = 0) -> bytes:
        """Compress the page at ``src_addr`` (optionally with the page at ``ref_addr`` as prefix).

        Addresses point into C-contiguous numpy page arrays that the caller keeps alive.
        """
        ctx = self._ctx()
        lib = ctx.lib
        if ref_addr:
            lib.ZSTD_CCtx_refPrefix(ctx.cctx, ref_addr, PAGE_SIZE)   # one-shot: next frame only
        n = lib.ZSTD_compress2(ctx.cctx, ctx.scratch_addr, BOUND_BYTES, src_addr, PAGE_SIZE)
        # zstd error codes are (size_t)-code, far above any real size: a range check spares
        # a second foreign call (ZSTD_isError) on this hot path.
        if n > BOUND_BYTES:
            lib.ZSTD_CCtx_reset(ctx.cctx, 1)          # ZSTD_reset_session_only
            raise RuntimeError("ZSTD_compress2 failed")
        return ctypes.string_at(ctx.scratch_addr, n)

    def compress(self, page: np.ndarray | bytes, ref: np.ndarray | bytes | None = None) -> bytes:
        if self.backend == "libzstd":
            p = np.ascontiguousarray(np.frombuffer(page, dtype=np.uint8) if isinstance(page, bytes) else page)
            r = None if ref is None else np.ascontiguousarray(
                np.frombuffer(ref, dtype=np.uint8) if isinstance(ref, bytes) else ref)
            return self.compress_addr(p.ctypes.data, 0 if r is None else r.ctypes.data)
        data = page if isinstance(page, bytes) else np.ascontiguousarray(page).tobytes()
        if ref is None:
            return bytes(self._py()[0].compress(data))
        d = zstandard.ZstdCompressionDict(bytes(ref), dict_type=zstandard.DICT_TYPE_RAWCONTENT)
        return bytes(zstandard.ZstdCompressor(compression_params=self._params, dict_data=d).compress(data))

    # -- decompression --------------------------------------------------------------------
    def decompress_into(self, payload: bytes, out: np.ndarray, ref: np.ndarray | None = None,
                        what: str = "page") -> None:
        """Decompress one page frame into ``out`` (a C-contiguous 4096-byte uint8 array)."""
        if self.backend == "libzstd":
            self.decompress_addr(payload, out.ctypes.data, 0 if ref is None else ref.ctypes.data, what)
            return
        try:
            if ref is None:
                data = self._py()[1].decompress(payload, max_output_size=PAGE_SIZE)
            else:
                d = zstandard.ZstdCompressionDict(bytes(ref), dict_type=zstandard.DICT_TYPE_RAWCONTENT)
                data = zstandard.ZstdDecompressor(dict_data=d, format=zstandard.FORMAT_ZSTD1_MAGICLESS
                                                  ).decompress(payload, max_output_size=PAGE_SIZE)
        except zstandard.ZstdError as err:
            raise StoreCorrupt(what, f"undecodable zstd frame: {err}") from err
        if len(data) != PAGE_SIZE:
            raise StoreCorrupt(what, f"frame decodes to {len(data)} bytes, not a page")
        out[:] = np.frombuffer(data, dtype=np.uint8)

    def decompress_addr(self, payload: bytes, out_addr: int, ref_addr: int = 0, what: str = "page") -> None:
        ctx = self._ctx()
        lib = ctx.lib
        if ref_addr:
            lib.ZSTD_DCtx_refPrefix(ctx.dctx, ref_addr, PAGE_SIZE)
        n = lib.ZSTD_decompressDCtx(ctx.dctx, out_addr, PAGE_SIZE, payload, len(payload))
        if n != PAGE_SIZE:                            # an error code, or not a whole page
            lib.ZSTD_DCtx_reset(ctx.dctx, 1)          # ZSTD_reset_session_only (drops a prefix)
            raise StoreCorrupt(what, "undecodable zstd frame" if lib.ZSTD_isError(n)
                               else f"frame decodes to {n} bytes, not a page")


    def patch_apply_addr(self, payload: bytes, ref_addr: int, out_addr: int, what: str = "page") -> None:
        """A PATCH payload onto the page at ``ref_addr`` (0: the zero page) into ``out_addr``,
        in C (the native library must be loaded)."""
        assert self.native is not None
        if self.native.azq_patch_apply(payload, len(payload), ref_addr or None, out_addr) != 0:
            raise StoreCorrupt(what, "malformed PATCH payload")

    # -- batch loops in C (see _pagecodec.c) -------------------------------------------------
    def encode_batch(self, m: int, up: np.ndarray, tp: np.ndarray, xp: np.ndarray | None, sp: np.ndarray,
                     sxp: np.ndarray | None, flags: np.ndarray, tiny: int, gain: int, small: int, raw_limit: int,
                     lz4_level: int = 0, out: np.ndarray | None = None, odds: np.ndarray | None = None,
                     astats: np.ndarray | None = None, seed: int = 0,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Run the attempts of ``m`` pages in C: (out, off, length, choice, tries) or None on
        failure. ``xp`` and ``sxp`` (page^template, page^reference) may be None: C then makes
        each page's XOR where its flags use it. ``out``: a contiguous uint8 buffer of
        m * BOUND_BYTES or more for the payloads (reused by the caller: the payloads are copied
        out before the next batch). ``odds``
        (uint8, ATTEMPT_SLOTS): the follow-up attempts' odds out of 256 (None: every attempt);
        ``astats`` (uint64, 2 * ATTEMPT_SLOTS): where their tries and saved bytes are added;
        ``seed``: of the draws."""
        ctx = self._ctx()
        if out is None or out.nbytes < m * BOUND_BYTES or out.dtype != np.uint8 or not out.flags.c_contiguous:
            out = np.empty(m * BOUND_BYTES, dtype=np.uint8)
        off = np.empty(m, dtype=np.uint32)
        length = np.empty(m, dtype=np.uint16)
        choice = np.empty(m, dtype=np.uint8)
        tries = np.zeros(6, dtype=np.uint64)
        flags = np.ascontiguousarray(flags, dtype=np.uint8)
        assert self.native is not None
        used = self.native.azq_encode_batch(
            ctx.cctx, m, up.ctypes.data, tp.ctypes.data, None if xp is None else xp.ctypes.data, sp.ctypes.data,
            None if sxp is None else sxp.ctypes.data,
            flags.ctypes.data, tiny, gain, small, raw_limit, lz4_level, out.ctypes.data, out.nbytes, off.ctypes.data,
            length.ctypes.data, choice.ctypes.data, tries.ctypes.data, _ptr(odds, np.uint8, ATTEMPT_SLOTS),
            _ptr(astats, np.uint64, 2 * ATTEMPT_SLOTS), seed & 0xFFFFFFFF)
        if used < 0:
            return None
        return out, off, length, choice, tries

    def decode_batch(self, payload: bytes | np.ndarray, src_off: np.ndarray, src_len: np.ndarray, method: np.ndarray,
                     ref_addr: np.ndarray, dst: np.ndarray, dst_row: np.ndarray,
                     check: np.ndarray | None = None) -> int:
        """Decode payloads into ``dst`` rows in C (the GIL is released meanwhile): -1 on
        success, i if payload i is not a page frame, -(i + 2) if page i fails ``check`` (given
        only when NATIVE_CHECKS; else the caller verifies)."""
        ctx = self._ctx()
        src_off = np.ascontiguousarray(src_off, dtype=np.uint32)
        src_len = np.ascontiguousarray(src_len, dtype=np.uint32)
        method = np.ascontiguousarray(method, dtype=np.uint8)
        ref_addr = np.ascontiguousarray(ref_addr, dtype=np.uint64)
        dst_row = np.ascontiguousarray(dst_row, dtype=np.int64)
        chk = None if check is None else np.ascontiguousarray(check, dtype=np.uint64)
        assert self.native is not None
        src = payload.ctypes.data if isinstance(payload, np.ndarray) else payload
        return int(self.native.azq_decode_batch(ctx.dctx, len(src_off), src, src_off.ctypes.data,
                                                src_len.ctypes.data, method.ctypes.data, ref_addr.ctypes.data,
                                                dst.ctypes.data, dst_row.ctypes.data,
                                                None if chk is None else chk.ctypes.data))


def _page_rows(x: np.ndarray) -> bool:
    """Whether ``x`` is what the C loops take as pages: C-contiguous uint8 rows of a page."""
    return x.dtype == np.uint8 and x.flags.c_contiguous and x.ndim == 2 and x.shape[1] == PAGE_SIZE


def classify_native(pages: np.ndarray, rows: np.ndarray, tpages: np.ndarray, kind: np.ndarray,
                    k_zero: int, k_template: int) -> bool:
    """The zero / same-address template test of ``len(kind)`` pages in C (_pagecodec.c's
    azq_classify): ``kind[i]`` becomes ``k_zero`` for an all-zero page, else ``k_template`` if
    the page equals ``tpages[rows[i]]`` (read in place; a negative row is a zero page), else
    stays. False, with ``kind`` untouched, when the library is not loaded or an array is not
    as the C loop needs it (the caller then does it in numpy)."""
    lib = _NATIVE
    n = len(kind)
    if (lib is None or pages.dtype != np.uint8 or not pages.flags.c_contiguous or pages.size != n * PAGE_SIZE
            or not _page_rows(tpages) or kind.dtype != np.uint8 or not kind.flags.c_contiguous
            or not kind.flags.writeable or len(rows) != n):
        return False
    r = np.ascontiguousarray(rows, dtype=np.int64)
    # ``tpages`` (the caller's reference, e.g. a view of the template's mapping) keeps the
    # mapping alive for the call; ctypes releases the GIL meanwhile.
    return int(lib.azq_classify(n, pages.ctypes.data, r.ctypes.data, tpages.ctypes.data, len(tpages),
                                kind.ctypes.data, k_zero, k_template)) == 0


def rows_equal(a: np.ndarray, a_row: np.ndarray, b: np.ndarray, b_row: np.ndarray) -> np.ndarray:
    """Whether page ``a[a_row[i]]`` equals page ``b[b_row[i]]``, for each i: the bytewise check
    of a hash match. In C (pages compared in place) where _pagecodec.so is built, else numpy
    (both sides gathered: two page copies a row)."""
    n = len(a_row)
    eq = np.zeros(n, dtype=np.uint8)
    if n == 0:
        return eq.astype(bool)
    ar = np.ascontiguousarray(a_row, dtype=np.int64)
    br = np.ascontiguousarray(b_row, dtype=np.int64)
    lib = _NATIVE
    if (lib is not None and _page_rows(a) and _page_rows(b)
            and int(lib.azq_rows_equal(n, a.ctypes.data, ar.ctypes.data, len(a), b.ctypes.data, br.ctypes.data,
                                       len(b), eq.ctypes.data)) == 0):
        return eq.astype(bool)
    return (a[ar].view(np.uint64) == b[br].view(np.uint64)).all(axis=1)


def compact_rows(pages: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
    """Move rows ``rows`` (strictly ascending) of ``pages`` to its first ``len(rows)`` rows,
    in place, and return that view; None where _pagecodec.so is not built or ``pages`` is not
    C-contiguous page rows (the caller copies them elsewhere). A bad row raises IndexError."""
    lib = _NATIVE
    if lib is None or not (_page_rows(pages) and pages.flags.writeable):
        return None
    r = np.ascontiguousarray(rows, dtype=np.int64)
    if int(lib.azq_compact_rows(pages.ctypes.data, len(pages), r.ctypes.data, len(r))) != 0:
        raise IndexError(f"compact_rows: rows must ascend strictly within 0..{len(pages) - 1}")
    return pages[:len(r)]


def run_loops_below(bg_nice: int, fg_nice: int) -> bool:
    """The calling thread runs the C loops of this module at nice ``bg_nice`` (the GIL
    released) and the rest of its work at ``fg_nice`` (_pagecodec.c, "Background work below
    the guests"); the thread must be at ``fg_nice`` already. False without the C library."""
    if _NATIVE is None:
        return False
    _NATIVE.azq_background_nice(bg_nice, fg_nice)
    return True


def loops_below_cpu_s() -> float:
    """CPU seconds the calling thread spent in C loops below its own priority (0 without the
    C library or ``run_loops_below``)."""
    return _NATIVE.azq_background_cpu_ns() / 1e9 if _NATIVE is not None else 0.0


def native_available() -> bool:
    return _NATIVE is not None


def available_backends() -> list[str]:
    return (["libzstd"] if _LIB is not None else []) + ["python"]
