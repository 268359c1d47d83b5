"""The native fault thread (restore/_faultloop.c): loading it and driving one per handler.

:class:`NativeLoop` owns the C thread of one FaultHandler. Python tells it, per RAM block, how
each source index is answered (``Action``); the thread answers those faults itself and forwards
the rest, and every UFFD_EVENT_REMOVE, to the handler's Python thread (``pop``). Counters and
service times live in C; the service-time ring is the handler's numpy array.

Without the library (not built by ``make lib``, or ``AZQ_NATIVE_FAULTS=0``) ``available()`` is
False and FaultHandler serves every fault in Python, as before.
"""

from __future__ import annotations

import ctypes
import enum
import os
from typing import Any

import numpy as np

from azqemu.pages import PAGE_SIZE
from azqemu.restore.errors import UffdIoctlError
from azqemu.restore.export import RamMapping
from azqemu.restore.source import (
    CompositeSource,
    MappedSource,
    PageSource,
    StoreSource,
    TemplateSource,
    ZeroSource,
)

ABI = 7
_V, _U64, _I64, _I = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int
EV_FAULT, EV_REMOVE = 1, 2
# Counter order of azq_fp_counters (C_* in _faultloop.c).
COUNTERS = ("faults", "served", "already_present", "retries", "stale", "other_events", "forwarded", "native",
            "dropped_at_stop", "from_template", "from_zero", "from_store", "around", "spin_caught", "spin_ns")


class Action(enum.IntEnum):
    """How the thread answers a fault on a page of one source index (A_* in _faultloop.c)."""

    FORWARD = 0       # the Python thread serves it
    CONTINUE = 1      # UFFDIO_CONTINUE from the file's page cache (a hole: the zero page)
    ZEROPAGE = 2      # UFFDIO_ZEROPAGE
    STORE = 3         # the store's C lookup, verified, then UFFDIO_COPY
    ZERO_COPY = 4     # UFFDIO_COPY of a zero page
    FILE = 5          # pread from the block's file (a lazy clone's template image), then UFFDIO_COPY


def _load() -> Any | None:
    if os.environ.get("AZQ_NATIVE", "1") == "0" or os.environ.get("AZQ_NATIVE_FAULTS", "1") == "0":
        return None
    path = os.environ.get("AZQ_FAULTLOOP_LIB") or os.path.join(os.path.dirname(__file__), "_faultloop.so")
    if not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.azq_faultloop_abi.restype = _I
        if lib.azq_faultloop_abi() != ABI:
            return None
        for name, args, res in (
                ("azq_fp_new", [_I, _I, _V, _U64], _V), ("azq_fp_free", [_V], None),
                ("azq_fp_set_block", [_V, _I, _U64, _U64, _I64, _I, _V, _U64, _I64, _I, _V, _V, _V], _I),
                ("azq_fp_set_action", [_V, _I, _I, _I], None), ("azq_fp_set_file", [_V, _I, _I, _I64], None), ("azq_fp_set_hot", [_V, _I, _V], None),
                ("azq_fp_record", [_V, _I64], None), ("azq_fp_samples", [_V], _U64),
                ("azq_fp_reset_samples", [_V], None), ("azq_fp_counters", [_V, _V], None),
                ("azq_fp_pop", [_V, _V, _I], _I), ("azq_fp_fwd_fd", [_V], _I), ("azq_fp_alive", [_V], _I),
                ("azq_fp_start", [_V, _I, _I64], _I), ("azq_fp_stop", [_V], None),
                ("azq_map_runs", [_I, _U64, _U64, _V, _V, _I64, _I, _V, _V], _I64)):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        return lib
    except (OSError, AttributeError):
        return None


LIB: Any = _load()      # None without the library
MAX_BLOCKS = 8
POP_BATCH = 64
HOT_MAPS_PINNED = 4          # the handler alternates two per block; more means a new handler map


def available() -> bool:
    return LIB is not None


def map_runs(uffd: int, hva: int, page_size: int, first: np.ndarray, count: np.ndarray, *, zero: bool) -> int:
    """mapback.map_from_file's loop in C (azq_map_runs): every run of pages mapped in one call.
    Returns the pages mapped; raises UffdIoctlError as the Python loop does."""
    first = np.ascontiguousarray(first, dtype=np.int64)
    count = np.ascontiguousarray(count, dtype=np.int64)
    err, err_page = ctypes.c_int(0), ctypes.c_int64(0)
    n = int(LIB.azq_map_runs(uffd, hva, page_size, first.ctypes.data, count.ctypes.data, len(first), int(zero),
                             ctypes.byref(err), ctypes.byref(err_page)))
    if n < 0:
        raise UffdIoctlError("UFFDIO_ZEROPAGE" if zero else "UFFDIO_CONTINUE", err.value,
                             hva + err_page.value * page_size, page_size)
    return n


class StoreViews:
    """The stores' native views a handler hands to its thread (one per store and sandbox:
    ``PageStore.native_view``), given back when the handler closes."""

    def __init__(self) -> None:
        self._views: list[tuple[Any, Any]] = []

    def view_of(self, s: StoreSource) -> Any:
        for store, v in self._views:
            if store is s.store and v.sandbox == s.sandbox:
                return v
        make = getattr(s.store, "native_view", None)
        v = make(s.sandbox) if make is not None else None
        if v is not None:
            self._views.append((s.store, v))
        return v

    def release_all(self) -> None:
        for store, v in self._views:
            store.release_native_view(v)
        self._views = []


def source_actions(sources: tuple[PageSource, ...], *, mapped: bool, page_size: int,
                   views: StoreViews) -> tuple[list[Action], int, int, TemplateSource | None]:
    """How the thread answers each source (by index), the store view its STORE pages come
    from and the file its FILE pages come from: (actions, decode function address, view
    address, template source). One store view and one file per block; pages of any other
    source are forwarded."""
    decode_addr = view_addr = 0
    file_src: TemplateSource | None = None
    actions: list[Action] = []
    for s in sources:
        act = Action.FORWARD
        if isinstance(s, TemplateSource) and page_size == PAGE_SIZE and s.fd >= 0 and file_src in (None, s):
            file_src = s
            act = Action.FILE
        elif isinstance(s, MappedSource) and mapped:
            act = Action.CONTINUE
        elif isinstance(s, ZeroSource) and page_size == PAGE_SIZE:
            act = Action.ZEROPAGE if mapped else Action.ZERO_COPY
        elif isinstance(s, StoreSource) and s.page_size == page_size == PAGE_SIZE:
            v = views.view_of(s)
            if v is not None and (not view_addr or v.address == view_addr):
                decode_addr, view_addr = v.decode_addr, v.address
                act = Action.STORE
        actions.append(act)
    return actions, decode_addr, view_addr, file_src


class NativeLoop:
    """One C fault thread for one uffd."""

    def __init__(self, uffd: int, n_blocks: int, ring: np.ndarray) -> None:
        assert LIB is not None
        if not 1 <= n_blocks <= MAX_BLOCKS:
            raise ValueError(f"the native fault thread serves 1..{MAX_BLOCKS} RAM blocks, not {n_blocks}")
        self._lib = LIB
        self._ring = ring                       # written by C: kept alive here
        self.handle = int(LIB.azq_fp_new(uffd, n_blocks, ring.ctypes.data, len(ring)) or 0)
        if not self.handle:
            raise MemoryError("azq_fp_new")
        self.fwd_fd = int(LIB.azq_fp_fwd_fd(self.handle))
        # Addresses taken once: ``ndarray.ctypes`` builds objects in a cycle at every use.
        self._events = np.zeros(3 * POP_BATCH, dtype=np.uint64)
        self._events_addr = int(self._events.ctypes.data)
        self._counters = np.zeros(len(COUNTERS), dtype=np.uint64)
        self._counters_addr = int(self._counters.ctypes.data)
        # Each block's hot maps (the handler alternates two) and their exports, pinned once.
        self._hot_pins: list[dict[int, Any]] = [{} for _ in range(n_blocks)]
        self._pins: list[Any] = []
        self._final_samples = 0
        self._files: dict[int, tuple[TemplateSource, int]] = {}
        self._stale_fds: list[int] = []

    def set_block(self, i: int, *, lo: int, hi: int, delta: int, shift: int, kinds: bytearray | None,
                  kinds_pages: int, base: int, block_action: Action, decode_addr: int, view_addr: int,
                  hot: bytearray) -> None:
        """``kinds``: a nibble per page (CompositeSource.kinds) for ``kinds_pages`` pages."""
        if not self.handle:
            return
        kinds_addr = self._pin(kinds) if kinds is not None else 0
        rc = self._lib.azq_fp_set_block(self.handle, i, lo, hi, delta, shift, kinds_addr or None,
                                        kinds_pages, base, int(block_action),
                                        decode_addr or None, view_addr or None, self._pin_hot(i, hot))
        if rc != 0:
            raise ValueError(f"block {i} out of range")

    def describe(self, i: int, block: RamMapping, source: PageSource, *, lo: int, hi: int, delta: int, shift: int,
                 mapped: bool, hot: bytearray, views: StoreViews) -> int:
        """Tell the thread how block ``i``'s pages are answered; returns the number of
        sources it was told about (a composite source may gain more later)."""
        composite = isinstance(source, CompositeSource)
        sources = source.sources if isinstance(source, CompositeSource) else (source,)
        actions, decode_addr, view_addr, file_src = source_actions(sources, mapped=mapped,
                                                                   page_size=block.page_size, views=views)
        if file_src is not None and self._files.get(i, (None, -1))[0] is not file_src:
            # A dup of its own: the source may close its descriptor while the thread reads.
            old = self._files.get(i, (None, -1))[1]
            fd = os.dup(file_src.fd)
            self._lib.azq_fp_set_file(self.handle, i, fd, file_src.base_offset)
            self._files[i] = (file_src, fd)
            if old >= 0:
                self._stale_fds.append(old)     # closed with the thread: it may be reading it
        self.set_block(i, lo=lo, hi=hi, delta=delta, shift=shift,
                       kinds=source.kinds if isinstance(source, CompositeSource) else None,
                       kinds_pages=source.page_count if isinstance(source, CompositeSource) else 0,
                       base=source.base_offset if isinstance(source, CompositeSource) else 0,
                       block_action=Action.FORWARD if composite else actions[0],
                       decode_addr=decode_addr, view_addr=view_addr, hot=hot)
        if composite:
            for k in range(256):
                self.set_action(i, k, actions[k] if k < len(actions) else Action.FORWARD)
        return len(sources)

    def set_action(self, i: int, kind: int, action: Action) -> None:
        if not self.handle:
            return
        self._lib.azq_fp_set_action(self.handle, i, kind, int(action))

    def set_hot(self, i: int, hot: bytearray) -> None:
        """Swap block ``i``'s hot map for another the handler keeps (the thread may still be
        writing the old one: it stays alive, pinned, as long as this loop)."""
        if not self.handle:
            return
        self._lib.azq_fp_set_hot(self.handle, i, self._pin_hot(i, hot))

    def _pin_hot(self, i: int, hot: bytearray) -> int:
        pins = self._hot_pins[i]
        obj = pins.get(id(hot))     # the pin keeps ``hot`` alive, so its id stays unique
        if obj is None:
            if len(pins) >= HOT_MAPS_PINNED:
                del pins[next(iter(pins))]      # the oldest: retired for several phases
            obj = pins[id(hot)] = (ctypes.c_char * len(hot)).from_buffer(hot)
        return ctypes.addressof(obj)

    def _pin(self, buf: bytearray) -> int:
        if not len(buf):
            return 0
        obj = (ctypes.c_char * len(buf)).from_buffer(buf)
        self._pins.append(obj)          # the export keeps the bytearray from being resized
        del self._pins[:-64]
        return ctypes.addressof(obj)

    def start(self, nice: int, spin_us: int) -> None:
        """Start the thread at ``nice``; after a fault it reads the uffd without sleeping for
        up to ``spin_us`` (adapted below it: fp_main in _faultloop.c)."""
        if not self.handle:
            raise RuntimeError("the native fault thread was closed")
        if self._lib.azq_fp_start(self.handle, nice, spin_us * 1000) != 0:
            raise RuntimeError("cannot start the native fault thread")

    def stop(self) -> None:
        """Join the thread (ctypes releases the GIL meanwhile); retries it held are forwarded."""
        if not self.handle:
            return
        self._lib.azq_fp_stop(self.handle)

    @property
    def alive(self) -> bool:
        return bool(self.handle and self._lib.azq_fp_alive(self.handle))

    def pop(self) -> list[tuple[int, int, int]]:
        """Forwarded events: (EV_FAULT, page address, 0) or (EV_REMOVE, start, end)."""
        out: list[tuple[int, int, int]] = []
        ev = self._events
        while True:
            n = int(self._lib.azq_fp_pop(self.handle, self._events_addr, POP_BATCH))
            if n == 0:
                return out
            flat = ev[:3 * n].tolist()
            out.extend(zip(flat[0::3], flat[1::3], flat[2::3]))

    def record(self, t_ns: int) -> None:
        if self.handle:
            self._lib.azq_fp_record(self.handle, t_ns)

    @property
    def samples(self) -> int:
        return int(self._lib.azq_fp_samples(self.handle)) if self.handle else self._final_samples

    def reset_samples(self) -> None:
        if self.handle:
            self._lib.azq_fp_reset_samples(self.handle)
        self._final_samples = 0

    def counters(self) -> dict[str, int]:
        """Cumulative; after ``close`` the last figures."""
        if self.handle:
            self._lib.azq_fp_counters(self.handle, self._counters_addr)
        return dict(zip(COUNTERS, (int(c) for c in self._counters)))

    def close(self) -> None:
        if self.handle:
            self._lib.azq_fp_stop(self.handle)
            self.counters()                        # the last figures stay readable
            self._final_samples = self.samples
            self._lib.azq_fp_free(self.handle)
            self.handle = 0
            self._pins = []
            for fd in [fd for _, fd in self._files.values()] + self._stale_fds:
                os.close(fd)
            self._files.clear()
            self._stale_fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    @property
    def state_bytes(self) -> int:
        """The C struct (queue of forwarded events, retry list, page buffer)."""
        return 1024 * 24 + 256 * 8 + 2 * 4096
