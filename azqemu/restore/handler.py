"""The fault server: answers every missing-page fault of a QEMU process.

One thread polls the handed-over uffd (O_NONBLOCK) and a stop eventfd, reads fault
messages in batches, fills a page from the block's :mod:`~azqemu.restore.source` and
places it with UFFDIO_COPY, which maps it and wakes every thread waiting on it (several
vCPUs faulting on one page are all woken by one copy).

Rules (DESIGN.md, "Restore"):

- UFFDIO_COPY only, never pwrite + UFFDIO_WAKE: COPY refuses (EEXIST) a page that is
  already present, so a bookkeeping slip cannot overwrite newer guest data. On EEXIST the
  page is back (another vCPU's fault, the prefetcher): wake the range and go on.
- Every fault gets an answer. A page that nobody saved is served as a zero page by
  UFFDIO_COPY from the source's ZeroSource, never answered by a bare wake (the thread
  would fault again). A page that *should* exist but cannot be produced (the source
  raises) is not answered at all: the thread keeps waiting and the error is reported.
  A blocked guest is recoverable; a guest that read a wrong page is not.
- EAGAIN from UFFDIO_COPY means the mm is changing (a non-cooperative event such as
  UFFD_EVENT_REMOVE is queued and the kernel holds copies until it is *read*): read the
  queue first, then retry; spinning on the copy would never make progress.

The fast path allocates no buffers per fault: the message buffer, the page buffer and
the ioctl argument are preallocated, and stats go into preallocated arrays.

Where ``make lib`` built it, a C thread reads the uffd instead (restore/native.py): it answers
mapped, zero, template-file and store pages without the GIL and forwards every other fault and
every REMOVE event to this thread. ``native=False`` or ``AZQ_NATIVE_FAULTS=0``: all here.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import select
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from azqemu import config
from azqemu.host.threads import FAULT_HANDLER_NICE, os_named, set_thread_nice
from azqemu.quantiles import quantiles
from azqemu.restore import native as cfaults
from azqemu.restore import uffd_abi as abi
from azqemu.restore.errors import UffdIoctlError
from azqemu.restore.export import RamMapping, UffdHandle
from azqemu.restore.hotmap import HotMaps
from azqemu.restore.source import CompositeSource, MappedSource, PageSource, ZeroSource, kind_in

log = logging.getLogger(__name__)

# Messages read per read(2). The kernel hands out at most what is queued; 64 covers a
# burst of every vCPU faulting plus REMOVE events with room to spare.
BATCH_MSGS = 64
# Service times kept for stats (a ring: the newest RING_SIZE faults), in ns as u32 (a fault
# served in over 4.29 s counts as 4.29 s): 8192 x 4 bytes = 32 KiB a sandbox; metrics read the
# ring at every scrape and count what a burst overwrote as lost, and the quantiles of 8192
# faults are as good as of more.
RING_SIZE = 1 << 13
RING_MAX_NS = (1 << 32) - 1
DISCARD_RANGES = 1024
# Poll timeout while faults wait for a source that answered Retry: short enough that a
# vCPU does not notice, long enough not to spin a shared core.
RETRY_INTERVAL_MS = 1


@dataclass(frozen=True)
class HandlerStats:
    faults: int              # page-fault messages read
    served: int              # answered with UFFDIO_COPY (CONTINUE or ZEROPAGE for mapped pages)
    already_present: int     # UFFDIO_COPY said EEXIST: woken instead
    retries: int             # Retry from a source or EAGAIN from the kernel
    errors: int              # faults left waiting because no content exists
    stale: int               # faults on a range no longer registered (ENOENT)
    removes: int             # UFFD_EVENT_REMOVE messages (QEMU discarded guest-freed pages)
    other_events: int
    service_us_median: float
    service_us_p99: float
    service_samples: int
    native_served: int = 0   # of the answered faults, those the C thread answered alone


class _Block:
    """Per-block state of the fast path (plain attributes: one lookup each)."""

    __slots__ = ("block", "lo", "hi", "delta", "shift", "source", "fill", "n_sources", "hot", "discarded", "out",
                 "mapped", "base", "zero_kind")

    def __init__(self, block: RamMapping, source: PageSource, page_mv: memoryview) -> None:
        self.block = block
        self.lo = block.hva
        self.hi = block.hva + block.size_bytes
        self.delta = block.offset - block.hva  # hva + delta = file offset
        self.shift = block.page_size.bit_length() - 1
        self.source = source
        self.fill = source.fill
        self.n_sources = -1              # sources the native thread was told about
        self.hot = HotMaps(block.page_count)
        # Ranges QEMU discarded (first page, end page): REMOVE events are rare, so a list;
        # past DISCARD_RANGES of them, a byte per page (smaller from there on).
        self.discarded: list[tuple[int, int]] | bytearray = []
        self.out = page_mv[:block.page_size]  # the page buffer, this block's page size
        # A copy-on-write block whose pages default to the template's page cache: pages of
        # source 0 in ``mapped`` are answered by UFFDIO_CONTINUE (CompositeSource.kinds), and
        # pages of its ZeroSource (registered before the handler starts) by UFFDIO_ZEROPAGE:
        # neither copies, neither costs the sandbox memory until the guest writes.
        self.mapped: bytearray | None = None
        self.base = 0
        self.zero_kind = -1
        if isinstance(source, CompositeSource) and isinstance(source.default, MappedSource):
            self.mapped = source.kinds
            self.base = source.base_offset
            self.zero_kind = next((i for i, src in enumerate(source.sources) if isinstance(src, ZeroSource)), -1)


def _mark_discarded(b: _Block, first: int, end: int) -> None:
    d = b.discarded
    if isinstance(d, list) and len(d) < DISCARD_RANGES:
        d.append((first, end))
        return
    if isinstance(d, list):
        marks = bytearray(b.block.page_count)
        for f, e in d:
            marks[f:e] = b"\x01" * (e - f)
        b.discarded = d = marks
    d[first:end] = b"\x01" * (end - first)


class FaultHandler:
    """Serve the faults of one UffdHandle from one PageSource per RAM block.

    ``sources`` is one source for every block or a sequence parallel to
    ``handle.blocks``. ``on_error(exc, hva)`` is called (from the handler thread) for a
    fault that cannot be served; ``on_remove(block_index, first_page, page_count)`` for
    each UFFD_EVENT_REMOVE (QEMU discarded pages the guest freed: their stored copies are
    dead; they stay served from the source until the caller reassigns them, which keeps
    the answer right even for an madvise that did not punch the file).
    """

    def __init__(self, handle: UffdHandle, sources: PageSource | Sequence[PageSource], *,
                 on_error: Callable[[BaseException, int], None] | None = None,
                 on_remove: Callable[[int, int, int], None] | None = None,
                 ring_size: int = RING_SIZE, name: str = "azq-fault-handler", native: bool | None = None) -> None:
        if not isinstance(sources, Sequence):
            sources = [sources] * len(handle.blocks)
        if len(sources) != len(handle.blocks):
            raise ValueError(f"{len(sources)} sources for {len(handle.blocks)} RAM blocks")
        self.handle = handle
        self._uffd = handle.uffd
        self._on_error = on_error
        self._on_remove = on_remove
        self._name = name
        max_page = max(b.page_size for b in handle.blocks)
        # Page buffer: mmap'd so it is page aligned (UFFDIO_COPY's src needs no alignment,
        # but aligned copies are the kernel's fast case), and its address is stable.
        self._page_map = mmap.mmap(-1, max_page)
        self._page_mv = memoryview(self._page_map)
        self._page_obj = ctypes.c_char.from_buffer(self._page_map)  # pins the buffer
        self._page_addr = ctypes.addressof(self._page_obj)
        self._blocks = tuple(_Block(b, s, self._page_mv) for b, s in zip(handle.blocks, sources))
        # ioctl arguments, reused: struct uffdio_copy as 5 u64 words, uffdio_range as 2.
        self._copy_arg = bytearray(ctypes.sizeof(abi.uffdio_copy))
        self._copy_q = memoryview(self._copy_arg).cast("Q")
        # struct uffdio_continue and uffdio_zeropage share one layout: range, mode, result.
        self._map_arg = bytearray(ctypes.sizeof(abi.uffdio_continue))
        self._map_q = memoryview(self._map_arg).cast("Q")
        self._range_arg = bytearray(ctypes.sizeof(abi.uffdio_range))
        self._range_q = memoryview(self._range_arg).cast("Q")
        self._msg_buf = bytearray(BATCH_MSGS * abi.UFFD_MSG_SIZE)
        self._msg_q = memoryview(self._msg_buf).cast("Q")
        self._ring_mask = ring_size - 1
        if ring_size <= 0 or ring_size & self._ring_mask:
            raise ValueError("ring_size must be a power of two")
        # numpy for the stats, written through a memoryview: an item store through it
        # costs a fraction of numpy's scalar assignment on the fast path.
        self._ring = np.zeros(ring_size, dtype=np.uint32)
        self._ring_mv = memoryview(self._ring.data)
        self._pending: list[int] = []   # hvas to retry (Retry, EAGAIN)
        self._failed: list[int] = []    # hvas left waiting after an error
        self.last_error: BaseException | None = None
        self._stop_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._stopping = False
        self._retry_requested = False
        self._thread: threading.Thread | None = None
        self._faults = 0
        self._served = 0
        self._eexist = 0
        self._retries = 0
        self._errors = 0
        self._stale = 0
        self._removes = 0
        self._other = 0
        self._samples = 0
        # The C thread, where the library is built (native None: wherever it is).
        self._native: cfaults.NativeLoop | None = None
        self._views = cfaults.StoreViews()           # the stores' native views handed to it
        if native is not False and cfaults.available() and len(self._blocks) <= cfaults.MAX_BLOCKS:
            self._native = cfaults.NativeLoop(self._uffd, len(self._blocks), self._ring)
            for i, b in enumerate(self._blocks):
                self._native_block(i, b)
        elif native:
            raise RuntimeError("the native fault thread is not available (make lib)")

    @property
    def native(self) -> bool:
        """True when a C thread reads the uffd (this thread serves what it forwards)."""
        return self._native is not None

    # -- the native thread's view of the sources ------------------------------------------
    def _native_block(self, i: int, b: _Block) -> None:
        """Tell the C thread how each source of block ``i`` is answered."""
        assert self._native is not None
        b.n_sources = self._native.describe(i, b.block, b.source, lo=b.lo, hi=b.hi, delta=b.delta, shift=b.shift,
                                            mapped=b.mapped is not None, hot=b.hot.current, views=self._views)

    def _native_refresh(self, b: _Block) -> None:
        """A forwarded fault: if the block's composite source gained sources since the C
        thread was told, tell it again (the next faults on them stay in C)."""
        src = b.source
        if isinstance(src, CompositeSource) and len(src.sources) != b.n_sources:
            self._native_block(self._blocks.index(b), b)

    # -- control -------------------------------------------------------------------------
    def start(self, *, wake: bool = True) -> None:
        """Start serving. ``wake`` wakes every block first: threads whose fault message
        was read by a previous manager that died wait for a wake-up no one else will
        send; woken, they fault again and their new message reaches us."""
        if self._thread is not None:
            raise RuntimeError("handler already started")
        self._stopping = False
        self._thread = threading.Thread(target=os_named(self._run), name=self._name, daemon=True)
        self._thread.start()
        if self._native is not None:
            self._native.start(FAULT_HANDLER_NICE, config.fault_spin_us())
        if wake:
            self.handle.wake_all()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread. Faults still queued stay queued for the next handler."""
        if self._thread is None:
            return
        if self._native is not None:
            self._native.stop()         # first: it forwards the retries it held
        self._stopping = True
        os.eventfd_write(self._stop_fd, 1)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"fault handler did not stop within {timeout_s} s")
        self._thread = None

    def close(self) -> None:
        self.stop()
        if self._stop_fd < 0:
            return
        if self._native is not None:
            self._native.close()
        self._views.release_all()
        os.close(self._stop_fd)
        self._stop_fd = -1
        for b in self._blocks:
            b.out.release()
        del self._page_obj
        self._page_mv.release()
        try:
            self._page_map.close()
        except BufferError:
            pass  # a source kept a view of the page buffer: freed with it

    def __enter__(self) -> FaultHandler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive()
                and (self._native is None or self._native.alive))

    def set_source(self, block_index: int, source: PageSource) -> None:
        """Serve block ``block_index`` from ``source`` from the next fault on."""
        b = self._blocks[block_index]
        b.source = source
        b.fill = source.fill
        if self._native is not None:
            self._native_block(block_index, b)

    def retry_failed(self) -> int:
        """Ask the handler thread to try the faults left waiting after errors again
        (after ``set_source`` fixed what was missing). Returns how many wait."""
        waiting = len(self._failed)
        self._retry_requested = True  # the loop moves them: it owns both lists
        os.eventfd_write(self._stop_fd, 1)  # wake the loop; _stopping stays False
        return waiting

    # -- results -------------------------------------------------------------------------
    def hot_pages(self, block_index: int = 0) -> np.ndarray:
        """Pages of the block (index from the block start) faulted since the last reset.

        The handler thread may mark pages while this runs (QEMU's own threads can fault
        with the vCPUs paused): work on a snapshot, or np.flatnonzero sees the count change.
        """
        return self._blocks[block_index].hot.indices()

    def reset_hot(self) -> None:
        for i, b in enumerate(self._blocks):
            current = b.hot.swap()      # swap, not clear: the loop may be writing a mark
            if self._native is not None:
                self._native.set_hot(i, current)

    def discarded_pages(self, block_index: int = 0) -> np.ndarray:
        """Pages QEMU discarded (UFFD_EVENT_REMOVE) since the last reset."""
        d = self._blocks[block_index].discarded
        if isinstance(d, bytearray):
            return np.flatnonzero(np.frombuffer(bytes(d), dtype=np.uint8))
        marks = np.zeros(self._blocks[block_index].block.page_count, dtype=bool)
        for first, end in list(d):
            marks[first:end] = True
        return np.flatnonzero(marks)

    def reset_discarded(self) -> None:
        for b in self._blocks:
            b.discarded = []

    def state_bytes(self) -> int:
        """Memory this handler holds for its sandbox: the hot maps (a bit per page), the
        discarded ranges, the service-time ring, the page and message buffers and the C
        thread's state."""
        per_page = sum(b.hot.nbytes + (len(b.discarded) if isinstance(b.discarded, bytearray)
                                     else 64 * len(b.discarded)) for b in self._blocks)
        c_part = self._native.state_bytes if self._native is not None else 0
        return int(per_page + self._ring.nbytes + len(self._page_map) + len(self._msg_buf) + c_part)

    def service_times_ns(self) -> np.ndarray:
        """Service times (fault message read to UFFDIO_COPY done) of the newest faults."""
        return self._ring[:min(self.samples_recorded, len(self._ring))].astype(np.int64)

    def reset_service_times(self) -> None:
        self._samples = 0
        if self._native is not None:
            self._native.reset_samples()

    @property
    def samples_recorded(self) -> int:
        """Service times recorded since the last reset; the newest is at (count - 1) & (ring size - 1)."""
        return self._native.samples if self._native is not None else self._samples

    def _record(self, t0: int) -> None:
        """One service time, from the fault message read (``t0``) to the page placed."""
        dt = time.perf_counter_ns() - t0
        if self._native is not None:
            self._native.record(dt)     # one ring, one counter: shared with the C thread
            return
        self._ring_mv[self._samples & self._ring_mask] = min(dt, RING_MAX_NS)
        self._samples += 1

    def stats(self) -> HandlerStats:
        t = self.service_times_ns()
        med, p99 = (q / 1e3 for q in quantiles(t, (50, 99))) if len(t) else (0.0, 0.0)
        c = self._native.counters() if self._native is not None else dict.fromkeys(cfaults.COUNTERS, 0)
        return HandlerStats(self._faults + c["faults"], self._served + c["served"],
                            self._eexist + c["already_present"], self._retries + c["retries"], self._errors,
                            self._stale + c["stale"], self._removes, self._other + c["other_events"], med, p99,
                            len(t), c["native"])

    def fault_count(self) -> int:       # stats().faults without the service-time quantiles
        return self._faults + (self._native.counters()["faults"] if self._native is not None else 0)

    def native_counters(self) -> dict[str, int]:     # the C thread's own (empty without it)
        return self._native.counters() if self._native is not None else {}

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        # A vCPU waits while its fault is served: the handler must win the CPU from the
        # guests that keep the host's cores busy (a wake-up a scheduler slice late is ms).
        set_thread_nice(FAULT_HANDLER_NICE)
        try:
            self._loop()
        except BaseException as exc:  # the thread must say why it died
            log.exception("fault handler died")
            self.last_error = exc
            raise

    def _loop(self) -> None:
        if self._native is not None:
            self._loop_forwarded(self._native)
            return
        uffd = self._uffd
        poller = select.poll()
        poller.register(uffd, select.POLLIN)
        poller.register(self._stop_fd, select.POLLIN)
        iov = [self._msg_buf]
        words = self._msg_q
        readv = os.readv
        clock = time.perf_counter_ns
        pagefault = abi.UFFD_EVENT_PAGEFAULT
        remove = abi.UFFD_EVENT_REMOVE
        serve = self._serve
        stop_fd = self._stop_fd
        while not self._stopping:
            ready = poller.poll(RETRY_INTERVAL_MS if self._pending else -1)
            if self._stopping:
                break
            self._woken(ready, (stop_fd,))
            try:
                nbytes = readv(uffd, iov)
            except BlockingIOError:
                nbytes = 0
            t0 = clock()
            blocks = self._blocks
            for w in range(0, nbytes >> 3, abi.MSG_WORDS):
                event = words[w] & 0xFF
                if event == pagefault:
                    self._faults += 1
                    serve(words[w + abi.MSG_WORD_PF_ADDRESS], blocks, t0)
                elif event == remove:
                    self._on_remove_event(words[w + abi.MSG_WORD_REMOVE_START],
                                          words[w + abi.MSG_WORD_REMOVE_END])
                else:
                    self._other += 1
            self._serve_pending(blocks)

    def _woken(self, ready: list[tuple[int, int]], eventfds: tuple[int, ...]) -> None:
        """After a poll: drain the eventfds that fired (retry_failed() wakes the loop through
        the stop fd too) and put the faults retry_failed() asked for back in line."""
        for fd, _ in ready:
            if fd in eventfds:
                try:
                    os.eventfd_read(fd)
                except BlockingIOError:
                    pass
        if self._retry_requested:
            self._retry_requested = False
            self._pending.extend(self._failed)
            self._failed = []

    def _serve_pending(self, blocks: tuple[_Block, ...]) -> None:
        # Retry after the batch: a REMOVE read before has released EAGAIN'd copies; what
        # fails again waits RETRY_INTERVAL_MS in the next poll, never spins.
        if self._pending:
            pending, self._pending = self._pending, []
            t0 = time.perf_counter_ns()
            for hva in pending:
                self._serve(hva, blocks, t0)

    def _loop_forwarded(self, nl: cfaults.NativeLoop) -> None:
        """The Python side of a native handler: what the C thread forwards (faults it does
        not answer itself, REMOVE events), served as ``_loop`` serves what it reads."""
        poller = select.poll()
        poller.register(nl.fwd_fd, select.POLLIN)
        poller.register(self._stop_fd, select.POLLIN)
        clock = time.perf_counter_ns
        serve = self._serve
        stop_fd, fwd_fd = self._stop_fd, nl.fwd_fd
        while not self._stopping:
            ready = poller.poll(RETRY_INTERVAL_MS if self._pending else -1)
            if self._stopping:
                break
            self._woken(ready, (stop_fd, fwd_fd))
            t0 = clock()
            blocks = self._blocks
            for kind, a, b in nl.pop():
                if kind == cfaults.EV_FAULT:
                    serve(a, blocks, t0, forwarded=True)
                elif kind == cfaults.EV_REMOVE:
                    self._on_remove_event(a, b)
            self._serve_pending(blocks)

    def _serve(self, address: int, blocks: tuple[_Block, ...], t0: int, forwarded: bool = False) -> None:
        for b in blocks:
            if b.lo <= address < b.hi:
                break
        else:
            # Only block ranges are ever registered: a fault elsewhere is a bug upstream.
            self._fail(UffdIoctlError("fault outside every RAM block", errno.EFAULT, address, 0), address)
            return
        if forwarded:
            self._native_refresh(b)
        shift = b.shift
        page = address >> shift << shift
        page_size = 1 << shift
        if b.mapped is not None and (k := kind_in(b.mapped, (page + b.delta - b.base) >> shift)) in (0, b.zero_kind):
            if self._map_from_file(page, page_size, zero=k != 0):
                b.hot.mark((page - b.lo) >> shift)
                self._record(t0)
            return
        try:
            ok = b.fill(page + b.delta, b.out)
        except Exception as exc:  # noqa: BLE001 - any source error leaves the fault waiting
            self._fail(exc, page)
            return
        if not ok:
            self._retries += 1
            self._pending.append(page)
            return
        cq = self._copy_q
        cq[0] = page
        cq[1] = self._page_addr
        cq[2] = page_size
        cq[3] = 0
        try:
            fcntl.ioctl(self._uffd, abi.UFFDIO_COPY, self._copy_arg, True)
        except OSError as err:
            if not self._copy_failed(err.errno, page, page_size):
                return
        else:
            self._served += 1
        b.hot.mark((page - b.lo) >> shift)
        self._record(t0)

    def _map_from_file(self, page: int, page_size: int, zero: bool = False) -> bool:
        """Answer a fault on a page the template holds: UFFDIO_CONTINUE maps its
        page-cache page; over a hole of the template file (EFAULT: nothing cached), or for
        a page known to be zero (``zero``), the zero page is the content. True if the fault
        counts as answered."""
        aq = self._map_q
        aq[0] = page
        aq[1] = page_size
        aq[2] = 0
        aq[3] = 0
        if not zero:
            try:
                fcntl.ioctl(self._uffd, abi.UFFDIO_CONTINUE, self._map_arg, True)
            except OSError as err:
                if err.errno != errno.EFAULT:
                    return self._copy_failed(err.errno, page, page_size, "UFFDIO_CONTINUE")
            else:
                self._served += 1
                return True
            aq[2] = aq[3] = 0
        try:
            fcntl.ioctl(self._uffd, abi.UFFDIO_ZEROPAGE, self._map_arg, True)
        except OSError as zerr:
            return self._copy_failed(zerr.errno, page, page_size, "UFFDIO_ZEROPAGE")
        self._served += 1
        return True

    def _copy_failed(self, err: int | None, page: int, page_size: int, op: str = "UFFDIO_COPY") -> bool:
        """Handle a failed UFFDIO_COPY (or CONTINUE, ZEROPAGE); True if the fault counts as answered."""
        if err == errno.EEXIST:
            # The page is back already; its waiters may not have been woken by whoever
            # placed it (a copy with DONTWAKE, a duplicate message): wake them.
            rq = self._range_q
            rq[0] = page
            rq[1] = page_size
            try:
                fcntl.ioctl(self._uffd, abi.UFFDIO_WAKE, self._range_arg, True)
            except OSError as werr:
                self._fail(UffdIoctlError("UFFDIO_WAKE", werr.errno or 0, page, page_size), page)
                return False
            self._eexist += 1
            return True
        if err == errno.EAGAIN:
            # mmap_changing: a REMOVE (or other non-cooperative) event waits to be read.
            self._retries += 1
            self._pending.append(page)
            return False
        if err == errno.ENOENT:
            # The range was unregistered after the fault was queued; UFFDIO_UNREGISTER
            # already woke the thread, which now finds the page in the file (or a hole).
            self._stale += 1
            return False
        if err == errno.ESRCH:
            # QEMU's mm is gone: the process exited. Nothing left to serve.
            self._stopping = True
            return False
        self._fail(UffdIoctlError(op, err or 0, page, page_size), page)
        return False

    def _fail(self, exc: BaseException, page: int) -> None:
        self._errors += 1
        self._failed.append(page)
        self.last_error = exc
        log.error("fault at %#x left waiting: %s", page, exc)
        if self._on_error is not None:
            self._on_error(exc, page)

    def _on_remove_event(self, start: int, end: int) -> None:
        # Known race (kept here, where it lives): the kernel sends REMOVE before zapping
        # the range and holds UFFDIO_COPY with EAGAIN until we read it. A fault in the
        # range read *before* the event may still be served from the source afterwards;
        # the guest freed those pages (balloon, free page reporting), so old content is
        # as valid as zero for it. QEMU punches the file before its madvise.
        self._removes += 1
        for i, b in enumerate(self._blocks):
            lo, hi = max(start, b.lo), min(end, b.hi)
            if lo >= hi:
                continue
            first = (lo - b.lo) >> b.shift
            last = (hi - b.lo + (1 << b.shift) - 1) >> b.shift
            _mark_discarded(b, first, last)
            if self._on_remove is not None:
                self._on_remove(i, first, last - first)
