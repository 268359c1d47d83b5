"""A sandbox's guest RAM under azqemu's control: fault serving, compress, resume.

One ``SandboxMemory`` per sandbox whose RAM the manager answers for (lazy clones from their
start, eager clones from their first compression). It holds the userfaultfd handed over by
the export library in QEMU (qemu-patches/), a fault handler thread, and a per-page source
map: pages stored in the page store come from the store, untouched pages of a lazy clone
from the template image, and pages nobody saved are zero.

Compress (vCPUs paused): scan the resident pages of the RAM memfd (data extents only),
encode them into the store, make a store generation naming them durable (``PageStore.flush``),
point their sources at the store, record the hot set (pages faulted in since the last resume),
and only then punch the stored pages out of the memfd: a manager killed at any point restarts
into a store that holds every page QEMU no longer has. A flush that finds no room
(``StoreFull``) abandons the compression before anything is dropped. Resume: put the hot
set back with UFFDIO_COPY in bulk, continue the vCPUs, serve the rest on first touch. A
resume that arrives while a compression runs cancels it between two steps; the resident
copies stay the truth (a copy-on-write clone keeps the entries made: ``_keep_entries``).

Copy-on-write clones (a MAP_PRIVATE mapping of the template's RAM image, ``RamMapping.private``)
keep everything the guest only read in the template's page cache, shared. Compress reads
the pages the guest wrote (anonymous copies, told apart through /proc/PID/pagemap), encodes
them, registers the range in MISSING+MINOR mode and has QEMU drop the copies
(MADV_DONTNEED, the export's DISCARD). Every page not in the store is then
mapped again at once, from the template's page cache (UFFDIO_CONTINUE) or to the zero page
(written pages that came out equal to the template's or zero; at the first compression the
untouched pages in 2 MiB spans that have a page table, the rest on first touch): no copy,
no memory of the sandbox's own. Resume copies the hot stored pages back. A known race
(a device writing guest RAM between the scan and the drop): docs/memory.md, "Known limits".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path

import numpy as np

from azqemu.daemon.callkinds import CallKinds, SplitResume, prefetch_pays
from azqemu.daemon.coldrule import ColdRule, CopyHistory
from azqemu.daemon.cpubudget import CpuBudget
from azqemu.daemon.memstats import CompressCancelled, CompressStats, ResumeStats, TrimStats, memory_stats
from azqemu.daemon.ramscan import RamScan, without_rows
from azqemu.daemon.rawrecord import RawPass, RawRecord
from azqemu.daemon.trimsort import TrimSort
from azqemu.errors import RestoreError, StoreError
from azqemu.host import selfmem
from azqemu.memory.accounting import OwnedBytes
from azqemu.memory.crashpoint import crash_point, fail_point
from azqemu.memory.kinds import Kind
from azqemu.memory.pagehash import page_hashes
from azqemu.memory.persist import StoreFull
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.pages import PAGE_SIZE, Scratch, in_sorted, intersect_idx, page_runs, setdiff_idx, union_idx
from azqemu.restore.export import UffdExport, UffdHandle
from azqemu.restore.handler import FaultHandler
from azqemu.restore.mapback import map_unstored, untouched_in_page_tables
from azqemu.restore.prefetch import Prefetcher
from azqemu.restore.source import (
    CompositeSource,
    MappedSource,
    PageSource,
    StoreSource,
    TemplateSource,
    ZeroSource,
)

log = logging.getLogger(__name__)

# QEMU creates the export socket when its constructor runs; a clone asks right after start.
EXPORT_CONNECT_TIMEOUT_S = 10.0


def _on_error(name: str, exc: BaseException, hva: int) -> None:  # FaultHandler's on_error
    log.error("%s: fault at %#x cannot be served (the guest waits): %s", name, hva, exc)


class SandboxMemory:
    """The memory side of one sandbox (thread-safe: one operation at a time)."""

    def __init__(self, name: str, sharing_domain: str, *, uffd_socket: Path, store: PageStore,
                 template: TemplateImage, template_ram: Path, lazy_clone: bool,
                 use_siblings: bool = True, owner: str | None = None) -> None:
        self.name = name
        # The domain UUID this memory belongs to: the store's entries are bound to it.
        self.owner = owner
        # The store binds a sharing domain to one template (TEMPLATE/TDELTA pages refer to
        # it); a tenant running clones of two templates gets one store domain per template.
        # Pages are still never shared across tenants.
        self.sharing_domain = f"{sharing_domain}@{template.template_id[:16]}"
        self.store = store
        self.template = template
        self.use_siblings = use_siblings
        self._lock = threading.Lock()
        self._handler_lock = threading.Lock()
        self._cancel = threading.Event()
        # A stop test from the caller (MemoryService's cancel tickets): true once a cancel was
        # asked after the operation was decided, even before it cleared ``_cancel``.
        self._stop_test: Callable[[], bool] | None = None
        self._ending = threading.Event()   # a destroy's cancel: compress and trim never clear it
        self._uffd_socket = str(uffd_socket)
        self.handle: UffdHandle = UffdExport.connect(self._uffd_socket, EXPORT_CONNECT_TIMEOUT_S)
        self.block = self.handle.main_block()
        self._block_index = self.handle.blocks.index(self.block)
        self.cow = self.block.private
        self.ram_fd = -1 if self.cow else self.handle.ram_fd(self.block)
        self.scan = RamScan(self.handle.pid, self.block.hva, self.block.page_count, self.ram_fd, self.cow)
        if self.block.offset != 0:
            raise RestoreError(f"{name}: guest RAM block starts at file offset {self.block.offset}")
        pages = self.block.page_count
        self._template_src: TemplateSource | None = None if self.cow else TemplateSource(template_ram)
        self._store_src = StoreSource(store, name)
        # What a page nobody stored is: the template's page cache itself (copy-on-write),
        # the template image's bytes (lazy clone), or zero (eager clone); copy-on-write,
        # pages known to be zero are mapped to the zero page (_zero_src), not copied.
        self._unstored: PageSource = ZeroSource()
        self._zero_src = ZeroSource()
        if self.cow:
            self._unstored = MappedSource()
        elif lazy_clone and self._template_src is not None:
            self._unstored = self._template_src
        self.sources = CompositeSource(pages, self.block.page_size, default=self._unstored)
        if self.cow:
            self.sources.register(self._zero_src)  # known to the fault handler from its start
            # The template file's holes are zero pages: so marked, a first touch maps its span's
            # template and zero pages in runs (_faultloop.c, map_around), a hole is no error.
            self.sources.assign(np.flatnonzero(template.rows(np.arange(pages)) < 0), self._zero_src)
        self.sources.register(self._store_src)     # so is the store (the native fault thread)
        if name in store.sandboxes():
            stored_owner = store.owner_of(name)
            if owner is not None and stored_owner is not None and stored_owner != owner:
                # Another domain's pages under a reused name: never served, freed.
                log.warning("%s: the store held pages of domain %s under this name (this one is %s): "
                            "freed", name, stored_owner, owner)
                store.free_sandbox(name)
                store.flush()
            else:
                # A restarted manager: pages stored before it died come from the store again.
                self.sources.assign(store.stored_pages(name), self._store_src)
        # No bound method (a cycle would keep a destroyed sandbox's maps until a full gc);
        # only the main RAM block is registered, others (if any) get zero sources.
        blocks = [self.sources if b is self.block else ZeroSource(b.page_size) for b in self.handle.blocks]
        self.handler = FaultHandler(self.handle, blocks, on_error=partial(_on_error, name),
                                    name=f"azq-faults-{name}")
        self.registered = False
        self._mapped_all = False      # a compression mapped every untouched page (_map_unstored)
        self.compressed = False
        self.hot_idx = np.empty(0, dtype=np.uint32)    # u32 between phases: half of int64's bytes
        self._prefetched_idx = np.empty(0, dtype=np.int64)
        self.calls = CallKinds(pages)      # the hot set per kind of tool call
        self._split = SplitResume(self.calls)   # a resume beside a call, in two parts
        self._history = CopyHistory()    # written copies the last trim saw (coldrule.py)
        self._raw = RawRecord()          # incompressible pages the last compression left (rawrecord.py)
        self._resumed_at = 0.0                              # monotonic s of the last prefetch
        self.cold = ColdRule()
        self._trimmed_at = 0.0                              # monotonic s of the last trim
        self._kept_unflushed = False      # entries kept from a cancel, not committed yet
        self.last_compress = CompressStats()
        self.last_resume = ResumeStats()
        self.compress_s_total = self.restore_s_total = self.trim_s_total = 0.0

    # -- life cycle ---------------------------------------------------------------------
    def attach(self) -> None:
        """Register the RAM block and start serving faults (lazy clones: before state load)."""
        with self._lock:
            self._serve()

    def _serve(self) -> None:
        """Register the RAM block (once) and run the fault handler; the caller holds the lock."""
        if not self.registered:
            self.handle.register(self.block.hva, self.block.size_bytes, minor=self.cow)
            self.registered = True
        self.restart_handler()

    def restart_handler(self) -> bool:
        """Start the fault handler if its thread is not running (first start, or after it died:
        the supervisor's call), under a lock of its own, not the memory lock. Returns whether it did."""
        with self._handler_lock:
            if self.handler.running:
                return False
            self.handler.stop()            # a dead thread: forget it
            self.handler.start(wake=True)  # faults read by the dead thread are asked again
            return True

    def detach(self) -> None:
        """Stop answering for this RAM: unregister first so no fault is left unserved."""
        with self._lock:
            if self.registered:
                try:
                    self.handle.unregister(self.block.hva, self.block.size_bytes)
                except Exception as exc:  # noqa: BLE001 - QEMU may already be gone
                    log.debug("%s: unregister: %s", self.name, exc)
                self.registered = False
            self.handler.stop()
            self.handler.close()
            self.handle.close()
            if self._template_src is not None:
                self._template_src.close()

    def cancel(self, *, for_good: bool = False) -> None:
        """Ask a running compression to stop at its next step; ``for_good`` (a destroy): and every later one."""
        if for_good:
            self._ending.set()
        self._cancel.set()

    def resident_bytes(self) -> int:
        """Guest RAM held for this sandbox alone (RamScan.resident_bytes)."""
        return self.scan.resident_bytes()

    def _encode(self, parts: Iterator[tuple[np.ndarray, np.ndarray]], hot_idx: np.ndarray | None,
                st: CompressStats | None = None, scratch: Scratch | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Encode (indices, pages) chunks into the store. Returns (stored, raw) page indices.
        ``hot_idx``: pages the next resume wants first (lazy clones: the cheap-to-decode codec).
        A failure forgets what earlier chunks encoded and raises (nothing was dropped: the
        resident copies are the truth); a cancel hands them to ``_keep_entries``."""
        stored: list[np.ndarray] = []
        raw: list[np.ndarray] = []
        try:
            for part, pages in parts:
                self._check_cancel()
                fail_point("encode-chunk", lambda: CompressCancelled(self.name))   # as a resume does
                hot = None if hot_idx is None else in_sorted(part, hot_idx)
                res = self.store.encode(self.name, self.sharing_domain, part, pages, self.template,
                                        use_siblings=self.use_siblings, hot=hot, owner=self.owner, scratch=scratch)
                stored.append(res.stored_idx.astype(np.int64))
                raw.append(res.raw_idx.astype(np.int64))
                if st is not None:
                    st.add_encoded(res.pages, res.bytes, res.tries)
        except CompressCancelled:
            if stored:
                self._keep_entries(np.concatenate(stored))
            raise
        except BaseException:
            if stored:
                self.store.discard(self.name, np.concatenate(stored))
            raise
        empty = np.empty(0, dtype=np.int64)
        # Chunks in page order: a stable sort (timsort) joins their runs in one pass.
        return (np.sort(np.concatenate(stored), kind="stable") if stored else empty,
                np.sort(np.concatenate(raw), kind="stable") if raw else empty)

    # -- compress -------------------------------------------------------------------------
    def compress(self, stop: Callable[[], bool] | None = None) -> CompressStats:
        """Encode and punch every profitable resident page (vCPUs paused). ``stop``: true when a
        cancel arrived since the compression was decided (it stops at its next step)."""
        self._cancel.clear()
        self._stop_test = stop
        st, t0 = CompressStats(), time.perf_counter()
        with self._lock:
            self._serve()
            idx = self.scan.index()
            st.resident_pages = len(idx)
            st.scan_s = time.perf_counter() - t0
            self._check_cancel()
            # The hot set of the phase that just ended: pages that came back since the last
            # resume by a fault or by the prefetch (untouched prefetched pages cannot be told
            # apart here), less prefetched pages a trim dropped unused. Ageing out by phases
            # was measured worse. Known before encoding: a lazy clone's store encodes them for
            # decode speed (PageStore.encode's hot).
            faulted = self.handler.hot_pages(self._block_index).astype(np.int64)
            hot_idx = union_idx(faulted, self._prefetched_idx)
            if self.cow:
                # The copies are pages the guest wrote (or that came back) since the last
                # compression, faults or not: at the first compression, when nothing could
                # fault yet, they are the whole working set the guest showed.
                hot_idx = union_idx(hot_idx, idx)
            t1 = time.perf_counter()
            # Only what changed is encoded (a copy equal to its entry by XXH3-128 keeps it; an
            # incompressible page not written since stays, untried: rawrecord.py): the CPU
            # follows what the guest wrote. Within the wait's CPU budget; the rest stays.
            held = self.name in self.store.sandboxes()      # its entries: none at its first
            kept: list[np.ndarray] = []
            taken: list[np.ndarray] = []
            raws = RawPass(self._raw, self.store, self.name, held)
            budget, scratch = CpuBudget(), Scratch()   # the buffers are this compression's

            def changed() -> Iterator[tuple[np.ndarray, np.ndarray]]:
                for part, pages in budget.chunks(self.scan.chunks(idx, scratch), taken):
                    key, check = page_hashes(pages)
                    same = (self.store.entries_match(self.name, part, key, check) if self.cow and held
                            else np.zeros(len(part), dtype=bool))
                    kept.append(part[same])
                    skip = same | raws.untried(part, key, check, same)
                    yield without_rows(part, pages, skip, scratch) if skip.any() else (part, pages)
            # Copy-on-write: hot pages are kept small, not fast (a resume copies back a few
            # thousand stored pages). Lazy clones bring back their whole working set.
            enc_stored, enc_raw = self._encode(changed(), None if self.cow else hot_idx, st, scratch)
            unchanged = np.concatenate(kept) if kept else np.empty(0, dtype=np.int64)
            done = np.concatenate(taken) if taken else np.empty(0, dtype=np.int64)
            self._raw, st.raw_untried_pages = raws.after(enc_raw), raws.untried_pages
            st.unchanged_pages, st.budget_stopped, st.left_pages = len(unchanged), budget.exceeded, len(idx) - len(done)
            crash_point("after-encode")
            st.encode_s = time.perf_counter() - t1
            st.stored_pages, st.raw_pages = len(enc_stored), len(self._raw)
            self.hot_idx = hot_idx.astype(np.uint32)
            # Kept for the kinds of call the phase ran; what it created comes back for any kind.
            came_back = union_idx(self._faulted_from_store(), self._prefetched_idx)
            self.calls.end_phase(hot_idx, setdiff_idx(idx, came_back))
            self._prefetched_idx = np.empty(0, dtype=np.int64)
            self.handler.reset_hot()
            st.hot_pages = len(self.hot_idx)
            self._history = CopyHistory.of_raw(self._raw.idx, self._raw.key, time.monotonic())   # trims anew
            self.cold.forget_drops()
            stored, free = self._commit(enc_stored)
            self.sources.assign(union_idx(stored, unchanged), self._store_src)
            t2 = time.perf_counter()
            try:
                dropped = np.setdiff1d(done, self._raw.idx, assume_unique=True)   # RAW, tried or not, stays
                if self.cow:
                    # Every copy goes but the incompressible ones, which stay resident.
                    self._discard_copies(dropped)
                else:
                    self._punch(stored)
            except CompressCancelled as cancel:
                # Pages not dropped yet are still resident (their entries kept copy-on-write).
                left = stored[cancel.done:]
                self._keep_entries(left)
                if not self.cow:
                    self.sources.assign(left, self._unstored)
                st.cancelled = True
            st.mapped_pages = self._settle(free, mapped=self.cow and not st.cancelled, dropped=dropped,
                                           commit=st.cancelled)
            crash_point("after-drop")
            st.punch_s = time.perf_counter() - t2
            st.total_s = time.perf_counter() - t0
            self.compressed = not st.cancelled
            self.compress_s_total += st.total_s
            self.last_compress = st
            return st

    def _keep_entries(self, encoded: np.ndarray) -> None:
        """Cancelled, nothing dropped: a copy-on-write clone keeps the entries made; its next
        compression or trim drops the copies still equal to them without encoding, committing
        first. Zero and template entries never match, nor does a lazy clone's: forgotten."""
        kinds = self.store.page_kinds(self.name, encoded) if self.cow else None
        free = encoded if kinds is None else encoded[(kinds == Kind.TEMPLATE) | (kinds == Kind.ZERO)]
        if len(free):
            self.store.discard(self.name, free)
        self._kept_unflushed = self._kept_unflushed or len(free) < len(encoded)

    def _commit(self, encoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Make this round's entries durable before any page is dropped. Returns the pages
        to drop that the store now serves and, copy-on-write, the free ones (template or
        zero again: mapped, not stored). A store that cannot commit forgets the round's
        entries and raises: nothing was dropped, the guest keeps every page."""
        stored = np.sort(encoded.astype(np.int64), kind="stable")    # ascending runs: merged
        free = np.empty(0, dtype=np.int64)
        if self.cow:
            stored, free = self._unstore_free_pages(stored)
        # Durable first, sources second, drop last: a page must be on disk and findable
        # before it disappears (write-ahead; docs/memory.md "Crash consistency").
        try:
            fail_point("flush-before-drop", lambda: StoreFull(str(self.store.root), "injected (AZQ_FAIL_AT)"))
            self.store.flush()
        except (StoreError, OSError) as exc:
            # Their space goes at the next commit or at once.
            log.error("%s: compression abandoned, the store could not commit: %s", self.name, exc)
            self.store.discard(self.name, encoded.astype(np.int64))
            raise
        crash_point("after-flush")
        self._kept_unflushed = False
        return stored, free

    def _settle(self, free: np.ndarray, *, mapped: bool, dropped: np.ndarray | None = None,
                commit: bool = True) -> int:
        """After the drop: map what is not stored (copy-on-write; ``dropped``: the pages just
        discarded), release the free pages' entries, ``commit`` (else the next commit does:
        docs/memory.md, "Crash consistency"). Returns the pages mapped."""
        n = self._map_unstored(dropped) if mapped else 0
        if len(free):
            # Mapped now (or still resident): entries kept durable through the DISCARD go.
            self.store.discard(self.name, free)
        if commit:
            try:
                self.store.flush()
                self._kept_unflushed = False
            except (StoreError, OSError) as exc:    # the durable generation names resident pages: never served
                log.warning("%s: store flush after the drop failed: %s", self.name, exc)
        return n

    def trim_due(self, every_s: float, backoff: bool = True) -> bool:
        """Whether a trim now could drop anything its predecessor could not: at most one per
        ``every_s``, and per ``ColdRule.trim_gap_s`` (half the cold age, or more after trims
        that dropped little, with ``backoff``), from the last trim or the resume since (a tool
        call's first trim waits for the pace its sandbox's trims had before the wait)."""
        since = max(self._trimmed_at, self._resumed_at)
        return (self.cow and not self.compressed
                and time.monotonic() - since >= max(every_s, self.cold.trim_gap_s(backoff)))

    def trim(self, stop: Callable[[], bool] | None = None,
             paused: Callable[[], AbstractContextManager[object]] = nullcontext) -> TrimStats:
        """``_trim``, then its freed buffers go back to the kernel, the template pages it read are forgotten."""
        st = self._trim(stop, paused)
        if st.resident_pages:
            self.template.drop_mapped()
            selfmem.trim_heap()
        self.trim_s_total += st.paused_s
        return st

    def _trim(self, stop: Callable[[], bool] | None,
              paused: Callable[[], AbstractContextManager[object]]) -> TrimStats:
        """Copy-on-write, in a tool call: drop the copies the guest is not using (docs/policies.md,
        on trims; which ones: trimsort.py): copies still equal to their stored entries, written
        copies whose hash has not moved for ``self.cold.after_s`` (encoded and committed durable
        first; incompressible ones stay), and zero copies at once. Scan, hashing, encoding and commit run
        beside the guest; only the drop runs in ``paused()``, of copies that still hash as
        they were read (one written meanwhile stays)."""
        st, t0 = TrimStats(), time.perf_counter()
        with self._lock:
            # Not stopped by a cancel left from the last resume; one from now on stops it.
            self._cancel.clear()
            self._stop_test = stop
            if not self.cow or not self.registered or self.compressed or self.name not in self.store.sandboxes():
                return st
            idx = self.scan.index()
            st.resident_pages = len(idx)
            if not len(idx):
                return st
            now = self._trimmed_at = time.monotonic()
            faulted = self._faulted_from_store()
            st.cold_after_s = self.cold.judge(faulted)
            sort = TrimSort(idx, now, faulted=faulted, cold_after_s=st.cold_after_s,
                            prefetch_cold=now - self._resumed_at >= st.cold_after_s, history=self._history,
                            entries_match=partial(self.store.entries_match, self.name))
            scratch = Scratch()
            drop = encoded = np.empty(0, dtype=np.int64)
            try:
                t1 = time.perf_counter()
                stored, enc_raw = self._encode(sort.sort(self.scan.chunks(idx, scratch), scratch), None,
                                               scratch=scratch)
                encoded = sort.encoded
                st.encode_s = time.perf_counter() - t1
                free = np.empty(0, dtype=np.int64)
                if len(encoded):
                    crash_point("after-encode")
                    stored, free = self._commit(stored)
                    self.sources.assign(stored, self._store_src)
                    st.encoded_pages, st.stored_pages = len(encoded), len(stored)
                    sort.raw |= in_sorted(idx, enc_raw)
                same = sort.same
                if len(same) and self._kept_unflushed:      # durable before their drop
                    self.store.flush()
                    self._kept_unflushed = False
                self.sources.assign(same, self._store_src)
                drop = union_idx(same, setdiff_idx(encoded, enc_raw))
                with paused() if len(drop) else nullcontext():      # nothing to drop: no pause
                    t2 = time.perf_counter()
                    rows = np.searchsorted(idx, drop)
                    kept_back = ~self.scan.unchanged(drop, sort.key[rows], sort.check[rows], scratch)
                    st.changed_pages = int(np.count_nonzero(kept_back))
                    drop = drop[~kept_back]
                    t3 = time.perf_counter()
                    self._discard_copies(drop)
                    st.dropped_pages = len(drop)
                    t4 = time.perf_counter()
                    self._settle(free, mapped=len(free) > 0, dropped=drop, commit=False)
                    st.paused_s = time.perf_counter() - t2
                    st.verify_s, st.drop_s, st.map_s = t3 - t2, t4 - t3, st.paused_s - (t4 - t2)
            except CompressCancelled:
                # A resume or destroy came first: nothing dropped, the entries stay (_keep_entries).
                drop = np.empty(0, dtype=np.int64)
                if st.encoded_pages:
                    self._keep_entries(encoded)
                    self._settle(np.empty(0, dtype=np.int64), mapped=False)
                st.encoded_pages = st.stored_pages = 0
            sort.keep_history(drop)
            zero = in_sorted(drop, sort.zero)
            st.zero_pages = int(np.count_nonzero(zero))
            # Zero drops are mapped to the zero page: no fault can tell the rule they came back.
            self.cold.note_dropped(drop[~zero], st.resident_pages, paid=len(drop))
            self.calls.note_trimmed(drop)
            # A prefetched page dropped unused by a tool call this long is not in this phase's
            # working set: the next resume need not bring it back.
            self._prefetched_idx = np.setdiff1d(self._prefetched_idx, drop, assume_unique=True)
            st.total_s = time.perf_counter() - t0
            return st

    def _faulted_from_store(self) -> np.ndarray:
        """Pages the guest came back for from the store since the last compression. A first
        touch of an untouched page faults too (a span the first compression left unmapped) but
        is no sign of use: counted, a file written in a tool call would never be trimmed."""
        faulted = self.handler.hot_pages(self._block_index)
        kinds = self.sources.kind_of(faulted)
        return faulted[kinds == self.sources.index_of(self._store_src)]

    def state_bytes(self) -> int:
        """Manager memory held for this sandbox between operations (a compression's buffers are freed)."""
        return int(len(self.sources.kinds) + self.handler.state_bytes() + self.hot_idx.nbytes + self.calls.nbytes
                   + self._prefetched_idx.nbytes + self._history.nbytes + self._raw.nbytes + self.cold.state_bytes())

    def _check_cancel(self, done: int = 0) -> None:
        if self._cancel.is_set() or self._ending.is_set() or (self._stop_test is not None and self._stop_test()):
            raise CompressCancelled(self.name, done)

    def _punch(self, stored: np.ndarray) -> None:
        """Punch the stored pages out of the memfd, in runs, watching for a cancel."""
        punched = 0
        starts, lengths = page_runs(stored)
        for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
            self._check_cancel(punched)
            self.handle.punch(self.block, s * PAGE_SIZE, n * PAGE_SIZE)
            punched += n
            crash_point("after-discard-batch")

    def _unstore_free_pages(self, stored: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Copy-on-write: written pages that are the template's again, or zero, need no entry
        (mapped, they cost nothing). Returns the pages left in the store and those free pages,
        whose entries the caller discards once they are mapped (until then the store is the
        only durable record that a discarded page was zero, not the template's)."""
        kinds = self.store.page_kinds(self.name, stored)
        same, zero = stored[kinds == Kind.TEMPLATE], stored[kinds == Kind.ZERO]
        self.sources.assign(same, self._unstored)
        self.sources.assign(zero, self._zero_src)
        keep = (kinds != Kind.TEMPLATE) & (kinds != Kind.ZERO)
        return stored[keep], union_idx(same, zero).astype(np.int64)

    def _discard_copies(self, pages: np.ndarray) -> None:
        """Copy-on-write: have QEMU drop these copies (the range is registered: a later touch
        comes to the handler). Cancellable only before the first madvise (the pages dropped
        are then no prefix of ``stored``)."""
        self._check_cancel()
        if len(pages):
            with UffdExport(self._uffd_socket, EXPORT_CONNECT_TIMEOUT_S) as export:
                export.discard_pages(self.block, pages)
            crash_point("after-discard-batch")
        self.handler.reset_discarded()    # our own madvise's REMOVE events: not the guest's

    def _map_unstored(self, dropped: np.ndarray | None = None) -> int:
        """Copy-on-write: map the pages neither mapped nor stored from the template's page
        cache (UFFDIO_CONTINUE) or as the zero page (holes, known zero): free for the sandbox
        (8 bytes of page table). The first compression walks the pagemap for the untouched
        pages in spans that have a page table (``untouched_in_page_tables``); later ones map only
        the pages just ``dropped``; the rest are mapped on first touch."""
        if dropped is not None and self._mapped_all:
            unmapped = np.asarray(dropped, dtype=np.int64)
        else:
            unmapped = untouched_in_page_tables(self.handle.pid, self.block, dropped)
            self._mapped_all = True
        kinds = self.sources.kind_of(unmapped)
        return map_unstored(self.handle.uffd, self.block, unmapped, kinds, self.sources.index_of(self._zero_src),
                            self.template.rows)

    # -- resume ---------------------------------------------------------------------------
    def prefetch(self, *, hot: bool = True, call: int | None = None, part: str = "all") -> ResumeStats:
        """Put back the pages the last call of kind ``call`` used (calls.note), else the last
        phase's; running: those of them trims dropped. None for a long call (prefetch_pays).

        ``part``: "early" then "rest" split a resume beside a call around the vCPUs' continue
        (callkinds.SplitResume; "early" leaves it compressed); "all" places every page first."""
        st, t0 = ResumeStats(), time.perf_counter()
        with self._lock:
            predicted = self.calls.predict(call)
            want = np.empty(0, dtype=np.int64)
            if hot and self.compressed and self.registered:     # detached meanwhile: its uffd is closed
                last = self.hot_idx.astype(np.int64) if predicted is None else predicted
                want = intersect_idx(last, self.store.stored_pages(self.name))
            elif hot and predicted is not None and self.registered and len(want := self.calls.trimmed(predicted)):
                # Only then the store's index and the pagemap (most calls find nothing trimmed).
                want = setdiff_idx(intersect_idx(want, self.store.stored_pages(self.name)), self.scan.index())
            if len(want) and not prefetch_pays(len(want), self.calls.call_s(call), self.calls.fault_stall_s()):
                st.left_pages, want = len(want), want[:0]     # a long call: first touch serves them
            want, present = self._split.pages(part, want, self.compressed), None
            if len(want):    # a page the guest faulted in meanwhile is skipped (EEXIST)
                if not self.compressed:
                    self.cold.note_back(want)
                with Prefetcher(self.handle.uffd) as pf:
                    r = pf.prefetch(self.block, want, self.sources)
                self._prefetched_idx = union_idx(self._prefetched_idx, want)
                st.prefetched_pages, st.prefetch_s, st.prefetch_mib_s = r.pages_copied, r.elapsed_s, r.mib_s
                st.present_pages = r.pages_present
                st.decode_s, st.copy_s, present = r.decode_s, r.copy_s, r.present_idx
            st.total_s = time.perf_counter() - t0
            self.restore_s_total += st.total_s
            if part == "early":
                self._split.early_done(want, st.total_s)
                return st
            if part == "rest" and self.compressed:
                pages, seconds = self._split.rest_done(present)
                st.prefetched_pages, st.total_s = st.prefetched_pages + pages, st.total_s + seconds
            self._resumed_at = time.monotonic() if self.compressed or len(want) else self._resumed_at
            self.compressed = False
            self.last_resume = st
            return st

    def stored_bytes(self, books: dict[str, OwnedBytes] | None = None) -> int:
        """Its bytes in the store (payloads, its share of shared ones, index); ``books``: read already."""
        ob = (books if books is not None else self.store.owned_bytes_many([self.name])).get(self.name)
        return 0 if ob is None else int(ob.private_bytes + ob.shared_bytes + ob.index_bytes)

    def call_counters(self) -> tuple[int, int, float]:
        """Cumulative: faults served, those from the store (hot set or trim missed), trim pauses s."""
        return self.handler.stats().faults, self.handler.native_counters().get("from_store", 0), self.trim_s_total

    def memstats(self, *, reset: bool = False) -> dict[str, object]:  # memstats.memory_stats
        return memory_stats(self, reset=reset)
