"""PageStore's tables readable from C, for fault threads that run without the GIL.

memory/_storeview.c looks a sandbox's page up and decodes it the way ``decode_page_into``
does. For that to be safe while Python changes the store:

- the store's state lock *is* the C mutex (:class:`NativeLock`), so a C lookup and a Python
  change to the tables never overlap, exactly as two Python threads never do;
- every array the C side reads is published to it, under that lock, whenever it is replaced:
  the blob table's rows (``BlobTable.on_change``), the arenas' mappings (``ArenaSet.on_change``),
  a sandbox's index (``PageStore`` after each commit, discard and free) and its template's rows
  and checks. The publisher keeps a reference to each published array, so none is freed while C
  may read it; the template's page view keeps the template's mapping alive likewise.

The fault thread (restore/_faultloop.c) gets a view's address and the address of
``azq_view_decode_inplace``; it never calls Python. Without the library (not built, or
``AZQ_NATIVE=0``) the store keeps a ``threading.RLock`` and every fault is served in Python.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

import numpy as np

from azqemu.host.threads import STORE_LOCK_NICE
from azqemu.memory.blobtable import BLOB_DTYPE, BlobTable
from azqemu.memory.pagehash import ZERO_CHECK
from azqemu.memory.sbxindex import SandboxIndex
from azqemu.memory.template import TemplateImage

ABI = 5
_V, _U64, _I = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int
# The packed row the C side reads (blob_row in _storeview.c): checked against BLOB_DTYPE at load.
_C_BLOB_OFFSETS = {"key": 0, "check": 8, "offset": 16, "ref": 20, "refcount": 24, "arena": 28, "length": 30,
                   "domain": 32, "method": 34, "reftype": 35}
# decode results (DEC_* in _storeview.c)
DEC_OK, DEC_NOT_STORED, DEC_CORRUPT, DEC_MISMATCH, DEC_UNSUPPORTED = range(5)


def _layout_matches() -> bool:
    fields: Any = BLOB_DTYPE.fields or {}
    return BLOB_DTYPE.itemsize == 36 and all(f in fields and fields[f][1] == o for f, o in _C_BLOB_OFFSETS.items())


def _load() -> Any | None:
    if os.environ.get("AZQ_NATIVE", "1") == "0" or os.environ.get("AZQ_NATIVE_FAULTS", "1") == "0":
        return None
    path = os.environ.get("AZQ_STOREVIEW_LIB") or os.path.join(os.path.dirname(__file__), "_storeview.so")
    if not os.path.exists(path) or not _layout_matches():
        return None
    from azqemu.memory import lz4page
    from azqemu.memory.zstdlib import _xxh3_128_address, _ZSTD_d_format, _ZSTD_f_zstd1_magicless

    try:
        lib = ctypes.CDLL(path)
        lib.azq_storeview_abi.restype = _I
        if lib.azq_storeview_abi() != ABI:
            return None
        for name, args, res in (
                ("azq_sv_set_helpers", [_V, _V, _I, _I, _U64], _I),
                ("azq_sv_page_check", [_V], _U64),
                ("azq_store_new", [], _V), ("azq_store_free", [_V], None),
                ("azq_store_lock", [_V, _I], _I), ("azq_store_trylock", [_V, _I, _V], _I),
                ("azq_store_unlock", [_V, _I, _I], None),
                ("azq_store_lock_waits", [_V, _V], None),
                ("azq_store_set_table", [_V, _V, _U64], None), ("azq_store_set_arenas", [_V, _V, _U64], None),
                ("azq_view_new", [_V], _V), ("azq_view_free", [_V], None),
                ("azq_view_set_index", [_V, _I, _V, _U64, _V, _V, _V, _V, _U64], None),
                ("azq_view_set_template", [_V, _V, _V, _V, _U64], None),
                ("azq_view_decode", [_V, _U64, _V], _I),
                ("azq_view_decode_many", [_V, _V, ctypes.c_long, _V], ctypes.c_long)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        lz4d = lz4page.function_addresses()[1]
        xxh = _xxh3_128_address()
        if not lib.azq_sv_set_helpers(lz4d or None, xxh or None, _ZSTD_d_format, _ZSTD_f_zstd1_magicless,
                                      ZERO_CHECK):
            return None
        if not _checks_agree(lib):
            return None
        return lib
    except (OSError, AttributeError):
        return None


def _checks_agree(lib: Any) -> bool:
    """The C checksum must be the store's (pagehash.py): checked once at load."""
    import xxhash

    page = np.frombuffer(bytes(range(256)) * 16, dtype=np.uint8).copy()
    return int(lib.azq_sv_page_check(page.ctypes.data)) == int.from_bytes(xxhash.xxh3_128_digest(page.data)[8:],
                                                                           "little")


LIB: Any = _load()      # None without the library
# Where the fault thread finds the lookup (0 without the library).
DECODE_INPLACE_ADDR = (ctypes.cast(LIB.azq_view_decode_inplace, ctypes.c_void_p).value or 0) if LIB is not None else 0


def available() -> bool:
    return LIB is not None


def _addr(buf: Any) -> int:
    """Address of a numpy array or bytes-like object's first byte (0 when empty)."""
    if isinstance(buf, np.ndarray):
        return int(buf.ctypes.data) if buf.size else 0
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


# _storeview.c: "no raise" for the lock's nice arguments.
NO_NICE = 100


class NativeLock:
    """A recursive lock that is a pthread mutex: PageStore's state lock when native faults are
    on. ctypes releases the GIL around the calls, so a thread waiting here lets the others run.
    Its holder runs at STORE_LOCK_NICE until its outermost release (host/threads.py): a fault
    thread waiting for the lock must not wait for a niced holder to get the CPU back. The
    raise and its give-back are made in C, the GIL released (_storeview.c)."""

    def __init__(self) -> None:
        assert LIB is not None
        self._lib = LIB
        self.handle = LIB.azq_store_new()
        if not self.handle:
            raise MemoryError("azq_store_new")
        self._held = threading.local()      # per thread: depth, and the nice value to give back
        # Off (AZQ_STORE_LOCK_BOOST=0): an ablation.
        self._raise = STORE_LOCK_NICE if os.environ.get("AZQ_STORE_LOCK_BOOST", "1") != "0" else NO_NICE
        self._give_back = ctypes.c_int(NO_NICE)     # trylock's out argument (read under the lock)

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        depth = getattr(self._held, "depth", 0)
        nice = self._raise if depth == 0 else NO_NICE
        if not blocking:
            if not self._lib.azq_store_trylock(self.handle, nice, ctypes.byref(self._give_back)):
                return False
            give_back = self._give_back.value
        else:
            give_back = self._lib.azq_store_lock(self.handle, nice)
        if depth == 0:
            self._held.give_back = give_back
        self._held.depth = depth + 1
        return True

    def release(self) -> None:
        depth = self._held.depth - 1
        self._held.depth = depth
        self._lib.azq_store_unlock(self.handle, self._raise, self._held.give_back if depth == 0 else NO_NICE)

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def fault_waits(self) -> dict[str, float | int]:
        """How long the fault side (C fault threads, the C prefetch decode) waited for this
        lock where it was busy, cumulative: every such wait stalls a vCPU."""
        out = np.zeros(4, dtype=np.uint64)
        self._lib.azq_store_lock_waits(self.handle, out.ctypes.data)
        return {"waits": int(out[0]), "wait_s": int(out[1]) / 1e9, "longest_us": int(out[2]) / 1e3,
                "over_1ms": int(out[3])}

    def __del__(self) -> None:
        try:
            self._lib.azq_store_free(self.handle)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class NativeView:
    """One sandbox of the store as the C lookup sees it. ``address`` goes to the fault thread
    with ``DECODE_INPLACE_ADDR``; ``decode_into`` is the same lookup called from Python."""

    def __init__(self, tables: NativeTables, sandbox: str) -> None:
        self.tables = tables
        self.sandbox = sandbox
        self.address = int(LIB.azq_view_new(tables.lock.handle))
        if not self.address:
            raise MemoryError("azq_view_new")
        self.users = 0
        self.decode_addr = DECODE_INPLACE_ADDR      # the lookup the fault thread calls with ``address``
        self._refs: tuple[Any, ...] = ()        # arrays published: alive while C may read them
        self._template: TemplateImage | None = None
        self._trefs: tuple[Any, ...] = ()

    def publish(self, index: SandboxIndex | None, template: TemplateImage | None) -> None:
        """Under the store's lock: what the C side reads for this sandbox from now on."""
        if index is None:
            LIB.azq_view_set_index(self.address, 0, None, 0, None, None, None, None, 0)
            self._refs = ()
        else:
            zt = np.frombuffer(bytes(index.zt), dtype=np.uint8)
            arrays = (np.ascontiguousarray(index.page, dtype=np.uint32), np.ascontiguousarray(index.kind, np.uint8),
                      np.ascontiguousarray(index.flags, np.uint8), np.ascontiguousarray(index.ref, np.uint32))
            LIB.azq_view_set_index(self.address, 1, _addr(zt) or None, len(zt),
                                   *[(_addr(a) or None) for a in arrays], len(arrays[0]))
            self._refs = (zt, *arrays)
        if template is not self._template:
            if template is None or template.closed:
                LIB.azq_view_set_template(self.address, None, None, None, 0)
                self._trefs = ()
            else:
                # The page view keeps the template's mapping open (TemplateImage.close).
                pages_z = template.pages_z
                slot_of = np.ascontiguousarray(template.slot_of, dtype=np.int32)
                checks = np.ascontiguousarray(template.checks, dtype=np.uint64)
                LIB.azq_view_set_template(self.address, _addr(pages_z) or None, _addr(slot_of),
                                          _addr(checks) or None, template.n_pages)
                self._trefs = (pages_z, slot_of, checks)
            self._template = template

    def decode_into(self, page_idx: int, out: np.ndarray) -> int:
        """The C lookup of one page into ``out`` (4096 bytes); a DEC_* code."""
        return int(LIB.azq_view_decode(self.address, page_idx, out.ctypes.data))

    def decode_many(self, page_idx: np.ndarray, out: np.ndarray) -> bool:
        """Pages ``page_idx`` into the rows of ``out`` ((n, 4096) uint8, C-contiguous), every
        one verified; False if any could not be (``out`` is then undefined)."""
        idx = np.ascontiguousarray(page_idx, dtype=np.int64)
        return int(LIB.azq_view_decode_many(self.address, idx.ctypes.data, len(idx), out.ctypes.data)) == -1

    def free(self) -> None:
        if self.address:
            LIB.azq_view_free(self.address)
            self.address = 0
            self._refs = self._trefs = ()


class NativeTables:
    """The store-wide arrays published to C (the blob table, the arenas) and the views."""

    def __init__(self) -> None:
        self.lock = NativeLock()
        self.views: dict[str, NativeView] = {}
        self._table_ref: Any = None
        self._arena_ref: Any = None

    def publish_table(self, table: BlobTable) -> None:
        with self.lock:
            rows = table.rows
            LIB.azq_store_set_table(self.lock.handle, _addr(rows) or None, table.n)
            self._table_ref = rows

    def publish_arenas(self, arenas: Any) -> None:
        """``arenas``: the store's ArenaSet (its open mappings by id)."""
        with self.lock:
            n = max(arenas.arenas, default=-1) + 1
            slots = np.zeros((max(n, 1), 2), dtype=np.uint64)
            for aid, a in arenas.arenas.items():
                slots[aid] = (arenas.address_of(a), a.capacity)
            LIB.azq_store_set_arenas(self.lock.handle, _addr(slots), n)
            self._arena_ref = slots

    def view(self, sandbox: str, index: SandboxIndex | None, template: TemplateImage | None) -> NativeView:
        """The view of ``sandbox`` (shared by its users), published now."""
        with self.lock:
            v = self.views.get(sandbox)
            if v is None:
                v = self.views[sandbox] = NativeView(self, sandbox)
                v.publish(index, template)
            v.users += 1
            return v

    def decode_many(self, sandbox: str, page_idx: np.ndarray, out: np.ndarray) -> bool:
        """The prefetch's bulk decode in C, through the sandbox's view while a user (its fault
        thread) holds one; False if there is none or a page could not be produced."""
        with self.lock:
            v = self.views.get(sandbox)
            if v is None:
                return False
            v.users += 1             # not freed under us by a handler closing meanwhile
        try:
            return v.decode_many(page_idx, out)
        finally:
            self.release(v)

    def release(self, view: NativeView) -> None:
        with self.lock:
            view.users -= 1
            if view.users <= 0 and self.views.get(view.sandbox) is view:
                del self.views[view.sandbox]
                view.free()

    def publish_sandbox(self, sandbox: str, index: SandboxIndex | None, template: TemplateImage | None) -> None:
        with self.lock:
            v = self.views.get(sandbox)
            if v is not None:
                v.publish(index, template)


def tables_or_none() -> NativeTables | None:
    """A store's native tables, or None without the library (the store keeps an RLock)."""
    return NativeTables() if LIB is not None else None
