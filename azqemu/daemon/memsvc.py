"""The memory service: the page store, the template images and each sandbox's guest RAM.

It owns the one ``PageStore`` (opened on first use), a ``TemplateImage`` per template, and
a ``SandboxMemory`` per sandbox whose RAM the daemon answers for (lazy clones from their
start, the others from their first compression). It attaches and releases that memory and
runs compress and prefetch on it; pausing and resuming the domain around them is the
lifecycle service's part.

Store entries are bound to the sandbox's domain UUID: a sandbox whose domain is gone or has
another UUID (a reused name) has its entries freed (``free_stale`` at reconcile, ``attach``
of a new clone, ``release`` at destroy). A store that cannot be opened is moved aside
(``store.unreadable-<time>``, kept for inspection) and a new one started; the sandboxes it
held are reported failed (``failed``: name -> reason, and ``on_failed``: the lifecycle's
state machine) and their memory is not served from anywhere else (a guest waits on a lost
page; it never gets a template or zero page instead). A ``FaultSupervisor`` (supervisor.py)
watches every fault handler: a dead one is started again, an unservable page retried, and a
sandbox whose faults stay unservable is failed with the reason. Each compression and each
resume of a compressed sandbox (its hot set back) is published as an event (``publish``:
the daemon's event log), done, cancelled or failed, with its figures.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from azqemu import config as config_mod
from azqemu.daemon import durations
from azqemu.daemon.callkinds import KindBook
from azqemu.daemon.eventlog import Publish, discard
from azqemu.daemon.sandboxmem import SandboxMemory
from azqemu.daemon.supervisor import FaultSupervisor, SupervisedMemory
from azqemu.errors import ConfigError, RestoreError, StoreCorrupt, StoreError, StoreForeign
from azqemu.host import selfmem, threads
from azqemu.memory import zstdlib
from azqemu.memory.crashpoint import crash_point
from azqemu.memory.persist import STORE_FILE, read_store
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.pages import PAGE_SIZE
from azqemu.restore.errors import PageUnavailable
from azqemu.sched import policy as policy_mod
from azqemu.virt.clones import SandboxRecord, SandboxRepo
from azqemu.virt.identity import vm_paths
from azqemu.virt.templates import TemplateMeta, TemplateRepo

log = logging.getLogger(__name__)
# Tool calls whose resumes put hot sets back at once (one thread each; more wait their turn,
# their guests served by faults meanwhile).
BESIDE_THREADS = 8


def unrestorable_reason(exc: BaseException) -> str:
    """A sandbox's failed reason when a resume cannot put its pages back (before or beside its vCPUs)."""
    return f"resume could not put its pages back: {type(exc).__name__}: {exc}"


class MemoryService:
    def __init__(self, cfg: config_mod.Config, templates: TemplateRepo, sandboxes: SandboxRepo, *,
                 lazy_available: bool) -> None:
        self.cfg = cfg
        self.templates = templates
        self.sandboxes = sandboxes
        # userfaultfd and the export library work here (doctor.restore_mode): without them
        # nothing can be compressed and clones copy their RAM.
        self.lazy_available = lazy_available
        self._store: PageStore | None = None
        self._store_lock = threading.Lock()
        # name -> (identity of the image file, its image): a template deleted and made again
        # under the same name is a different file, never decoded against the old image.
        self._template_images: dict[str, tuple[tuple[float, int, int], TemplateImage]] = {}
        self.mem: dict[str, SandboxMemory] = {}
        # Per sharing domain: the kinds of tool call its sandboxes ran and their working sets
        # (callkinds.KindBook), while one of its sandboxes lives.
        self.kind_books: dict[str, KindBook] = {}
        self.compress_cpu_s: dict[str, float] = {}   # compressing thread's CPU time per sandbox
        # ... of which its C loops ran below the guests with the rest above (AZQ_COMPRESS_LOOPS_BELOW=1)
        self.compress_cpu_loops_below_s: dict[str, float] = {}
        self.compress_count: dict[str, int] = {}     # compressions that finished, per sandbox
        # Its bytes in the store as its last compression left them (its compress event's
        # figure): the domain metadata shows them without a pass over the blob rows.
        self.last_stored_bytes: dict[str, int] = {}
        # Bytes that reached the encoder, per sandbox: pages new or changed since they were
        # last stored (a copy-on-write clone's unchanged copies are skipped), i.e. about what
        # the guest wrote; what compression CPU is paid per (bench density's per-MiB figure).
        self.compress_encoded_bytes: dict[str, int] = {}
        self.restore_count: dict[str, int] = {}      # resumes of a compressed sandbox, per sandbox
        self._beside: ThreadPoolExecutor | None = None   # prefetch_beside's threads, made on first use
        self._beside_lock = threading.Lock()
        selfmem.bound_heap_caching()
        # Sandboxes whose stored pages were lost (a quarantined store or index): name -> reason.
        self.failed: dict[str, str] = {}
        # Told of every failure (name, reason): the lifecycle's state machine (Registry.fail).
        self.on_failed: Callable[[str, str], object] | None = None
        # Cancels asked per sandbox (a counter). An operation takes a ticket (the count) when
        # it is decided, before its checks; it stops if the count moved, also when the cancel
        # came before the operation reached its first step (``cancel_ticket``).
        self._cancels: dict[str, int] = {}
        self._cancels_mu = threading.Lock()
        self._compressing: dict[str, int] = {}   # sandbox -> native id of the thread compressing it
        # Compressions and resumes as events (the manager's event log).
        self.publish: Publish = discard
        # Held around a detach and a supervisor's restart of a handler.
        self._handlers_guard = threading.Lock()
        self.supervisor = FaultSupervisor(self._supervised, self._fail, self._handlers_guard)

    # -- the store and the template images ----------------------------------------------
    @property
    def store_root(self) -> Path:
        return self.cfg.shm_dir / "store"

    @property
    def store(self) -> PageStore:
        with self._store_lock:
            if self._store is None:
                root = self.store_root
                try:
                    self._store = PageStore(root)
                except (StoreForeign, StoreCorrupt) as exc:
                    self._store = self._quarantine_store(root, exc)
                for name, reason in self._store.quarantined.items():
                    self._fail(name, f"its stored pages are lost (index quarantined: {reason})")
            return self._store

    def _quarantine_store(self, root: Path, exc: StoreError) -> PageStore:
        """Move an unreadable store aside, start a new one, report the sandboxes it held."""
        names: list[str] = []
        try:
            meta, _ = read_store(root / STORE_FILE)
            names = [str(s["name"]) for s in meta.get("sandboxes", [])]
        except (StoreError, KeyError, TypeError):
            # Not even its list of sandboxes: any of ours may have had pages in it.
            names = [r.name for r in self.sandboxes.list()]
        stale = root.with_name(f"store.unreadable-{int(time.time())}")
        if names:
            log.error("%s; moved to %s (kept for inspection), starting a new store", exc, stale)
        else:
            log.warning("%s; no sandbox uses it: moved to %s, starting a new store", exc, stale)
        os.rename(root, stale)
        if not names:
            shutil.rmtree(stale, ignore_errors=True)
        for name in names:
            self._fail(name, f"its stored pages are lost (store quarantined at {stale}: {exc})")
        return PageStore(root)

    def _fail(self, name: str, reason: str) -> None:
        self.failed[name] = reason
        log.error("sandbox %s failed: %s", name, reason)
        if self.on_failed is not None:
            self.on_failed(name, reason)

    def _supervised(self) -> list[tuple[str, SupervisedMemory]]:
        return list(self.mem.items())

    def loaded_templates(self) -> list[TemplateImage]:
        """The template images the manager holds (mapped, indexed) now."""
        with self._store_lock:
            return [img for _, img in self._template_images.values()]

    def opened_store(self) -> PageStore | None:
        """The store if it was opened (accounting must not create one to read it)."""
        return self._store

    def has_stored(self, name: str) -> bool:
        """Whether the store holds pages of ``name`` (without making a store where none is)."""
        return self.store_root.exists() and name in self.store.sandboxes()

    def template_image(self, tmpl: TemplateMeta) -> TemplateImage:
        """The template's image: a shared read-only mapping of its tmpfs file, made once per
        file (identity: the template's creation time and the file's device and inode)."""
        path = self.templates.ram_path(tmpl.name)
        st = os.stat(path)
        ident = (tmpl.created_at, st.st_dev, st.st_ino)
        with self._store_lock:
            cached = self._template_images.get(tmpl.name)
            if cached is not None and cached[0] == ident:
                return cached[1]
            img = TemplateImage(path)
            self._template_images[tmpl.name] = (ident, img)
        if cached is not None:  # replaced: sandboxes still using the old image keep it alive
            self._forget_image(cached[1], close=False)
        return img

    def drop_template(self, name: str) -> None:
        """The template is gone: unmap its image (a mapping would pin a deleted file's pages)."""
        with self._store_lock:
            cached = self._template_images.pop(name, None)
        if cached is not None:
            self._forget_image(cached[1], close=True)

    def _forget_image(self, img: TemplateImage, *, close: bool) -> None:
        with self._store_lock:
            in_use = any(i.template_id == img.template_id for _, i in self._template_images.values())
        if self._store is not None and not in_use:
            self._store.drop_template(img.template_id)
            self._flush_books("a deleted template")
        if close:
            img.close()
        selfmem.trim_heap()

    # -- a sandbox's memory -------------------------------------------------------------
    def get(self, name: str) -> SandboxMemory | None:
        return self.mem.get(name)

    def compressed(self, name: str) -> bool:
        mem = self.mem.get(name)
        return bool(mem is not None and mem.compressed)

    def attach(self, name: str, sharing_domain: str, tmpl: TemplateMeta, *,
               lazy_clone: bool, use_siblings: bool = True, owner: str | None = None) -> SandboxMemory:
        """Take over a sandbox's RAM: connect to its export and, for a lazy clone or a
        sandbox with pages in the store, start serving its faults.

        ``owner`` is the domain UUID (default: the record's). Without one and without a
        record this is a new clone: whatever the store holds under its name is another
        domain's and is freed first."""
        if owner is None and self.sandboxes.path(name).exists():
            owner = self.sandboxes.get(name).uuid
        if owner is None and self.has_stored(name):
            self._free_entries(name, "a new sandbox reuses the name")
        mem = SandboxMemory(name, sharing_domain, uffd_socket=vm_paths(name, self.cfg).uffd_socket,
                            store=self.store, template=self.template_image(tmpl),
                            template_ram=self.templates.ram_path(tmpl.name), lazy_clone=lazy_clone,
                            use_siblings=use_siblings, owner=owner)
        if lazy_clone or self.has_stored(name):
            if owner is not None and self.has_stored(name):
                # A restarted manager (or a first compression's attach): the stored pages are
                # the store's again in the sources; nothing serves faults yet.
                crash_point("after-reattach")
            mem.attach()
        with self._handlers_guard:    # a detach drops a domain's book when its last sandbox goes
            mem.calls.siblings = self.kind_books.setdefault(mem.sharing_domain, KindBook())
            self.mem[name] = mem
        self.supervisor.ensure_started()
        return mem

    def cancel_ticket(self, name: str) -> int:
        """The ticket of an operation (compress, trim) on ``name`` decided now: it stops at
        its next step once a cancel is asked after this call. Taken under the sandbox's lock
        before the operation's checks (phase, execs), so that a cancel asked between the
        checks and the operation's start is not lost: that cancel's caller (a resume, an
        exec, a tool hint) has already changed what the checks look at, or its cancel comes
        after the ticket."""
        with self._cancels_mu:
            return self._cancels.get(name, 0)

    def stop_test(self, name: str, ticket: int | None) -> Callable[[], bool] | None:
        if ticket is None:
            return None
        return lambda: self._cancels.get(name, 0) != ticket

    def cancel(self, name: str, *, for_good: bool = False) -> None:
        """Stop a compression of ``name`` in progress at its next step (if there is one),
        and one decided before this call that has not started yet (``cancel_ticket``);
        ``for_good`` (a destroy): every later one too (SandboxMemory.cancel)."""
        with self._cancels_mu:
            self._cancels[name] = self._cancels.get(name, 0) + 1
            mem = self.mem.get(name)
            if mem is not None:
                mem.cancel(for_good=for_good)
            tid = self._compressing.get(name)
            if tid is not None:
                # Compressions run far below the guests; the caller (an exec, a resume, a
                # destroy) waits for this one to stop: it does so at the guests' priority and above.
                threads.set_nice_of(tid, threads.PAUSED_GUEST_NICE)

    def detach(self, name: str) -> None:
        """Stop answering for the RAM of ``name``; its pages stay in the store."""
        with self._handlers_guard:
            mem = self.mem.pop(name, None)
            if mem is not None:
                mem.detach()
                if all(m.sharing_domain != mem.sharing_domain for m in self.mem.values()):
                    self.kind_books.pop(mem.sharing_domain, None)

    def release(self, name: str) -> None:
        """Detach, and free the sandbox's pages and references in the store."""
        self.detach(name)
        self.failed.pop(name, None)
        self.compress_cpu_s.pop(name, None)
        self.compress_cpu_loops_below_s.pop(name, None)
        self.compress_count.pop(name, None)
        self.last_stored_bytes.pop(name, None)
        self.compress_encoded_bytes.pop(name, None)
        self.restore_count.pop(name, None)
        with self._cancels_mu:
            self._cancels.pop(name, None)   # a later ticket of the name starts at 0: an older one stops
        if self.has_stored(name):
            # Tombstoned: the domain goes after this; if the manager dies in between, the
            # next one finds the domain running without its pages and fails it (free_stale).
            self._free_entries(name, "destroyed", tombstone=True)
        for gone in [n for n in list(self._template_images) if not self.templates.exists(n)]:
            self.drop_template(gone)
        selfmem.trim_heap()

    def domain_gone(self, name: str) -> None:
        """The domain of ``name`` is gone (destroyed, or ended by itself and released): the
        tombstone its destroy left has done its work and goes, committed now. Before, a daemon
        kept every name it ever destroyed and wrote them all into every generation of the store
        (one a compression), until a restart's reconcile dropped them."""
        if self.store_root.exists():
            self.store.clear_tombstone(name)
            self._flush_books("a destroyed name")

    def _flush_books(self, what: str) -> None:
        """Commit the store's books now that ``what`` left them (nothing to write: no-op). A
        failure only delays it to the next commit: nothing the guests need is in it."""
        try:
            self.store.flush()
        except StoreError as exc:
            log.warning("the store's record of %s stays until its next commit: %s", what, exc)

    def _free_entries(self, name: str, why: str, *, tombstone: bool = False) -> None:
        log.info("freeing the stored pages of %s (%s)", name, why)
        self.store.free_sandbox(name, tombstone=tombstone)
        self.store.flush()

    def free_stale(self, running: dict[str, str]) -> list[str]:
        """Free the entries of every sandbox whose domain is gone or has another UUID than
        the one they are bound to (``running``: name -> domain UUID). Returns their names.
        A running domain whose pages a destroy freed (tombstone, same UUID) is failed."""
        if not self.store_root.exists():
            return []
        freed = []
        for name, owner in self.store.tombstones().items():
            if name in running and owner in (None, running[name]):
                self._fail(name, "a destroy freed its stored pages and was interrupted before the domain went")
            else:
                self.store.clear_tombstone(name)
        for name in self.store.sandboxes():
            owner = self.store.owner_of(name)
            if name not in running:
                why = "its domain is gone"
            elif owner is not None and owner != running[name]:
                why = f"bound to domain {owner}, the running one is {running[name]}"
            else:
                continue
            self.store.free_sandbox(name)
            log.info("freeing the stored pages of %s (%s)", name, why)
            freed.append(name)
        self.store.flush()     # nothing to write if nothing changed
        return freed

    def compress(self, rec: SandboxRecord, ticket: int | None = None) -> dict[str, Any]:
        """Encode the sandbox's resident RAM into the store and punch it (vCPUs paused);
        cancelled at its first step if a cancel came after ``ticket`` (cancel_ticket)."""
        mem = self.mem.get(rec.name)
        if mem is None:
            mem = self.attach(rec.name, rec.sharing_domain, self.templates.get(rec.template),
                              lazy_clone=rec.ram_mode == "lazy",
                              use_siblings=policy_mod.get(rec.policy).use_siblings, owner=rec.uuid)
        if mem.owner is None:
            mem.owner = rec.uuid     # attached at clone time, before the record existed
        cpu0, below0 = time.thread_time(), zstdlib.loops_below_cpu_s()
        t0 = time.perf_counter()
        try:
            with threads.nice_restored():
                with self._cancels_mu:
                    self._compressing[rec.name] = threading.get_native_id()   # for cancel
                try:
                    st = mem.compress(stop=self.stop_test(rec.name, ticket))
                finally:
                    with self._cancels_mu:
                        self._compressing.pop(rec.name, None)
        except BaseException as exc:
            self.publish(rec.name, "compress", "failed", reason=f"{type(exc).__name__}: {exc}",
                         duration_s=round(time.perf_counter() - t0, 6))
            raise
        finally:
            cpu_s = time.thread_time() - cpu0
            self.compress_cpu_s[rec.name] = self.compress_cpu_s.get(rec.name, 0.0) + cpu_s
            self.compress_cpu_loops_below_s[rec.name] = (self.compress_cpu_loops_below_s.get(rec.name, 0.0)
                                                         + zstdlib.loops_below_cpu_s() - below0)
            mem.template.drop_mapped()
            selfmem.trim_heap()
        durations.COMPRESS_SECONDS.observe(st.total_s)
        if not st.cancelled:
            self.compress_count[rec.name] = self.compress_count.get(rec.name, 0) + 1
            encoded = max(0, st.resident_pages - st.left_pages - st.unchanged_pages - st.raw_untried_pages) * PAGE_SIZE
            self.compress_encoded_bytes[rec.name] = self.compress_encoded_bytes.get(rec.name, 0) + encoded
        stored_bytes = self.last_stored_bytes[rec.name] = mem.stored_bytes()
        # Copy-on-write, finished: every copy it read went but the incompressible ones (a scan
        # of the RAM's page tables would take 1.5 ms to say so). Otherwise: scanned.
        whole = mem.cow and not st.cancelled and st.left_pages == 0
        resident_bytes = st.raw_pages * PAGE_SIZE if whole else mem.resident_bytes()
        log.debug("%s: compressed %d of %d resident pages, %d mapped back; scan %.4f s, encode %.4f s, "
                  "drop %.4f s, total %.4f s, CPU %.4f s%s", rec.name, st.stored_pages, st.resident_pages,
                  st.mapped_pages, st.scan_s, st.encode_s, st.punch_s, st.total_s, cpu_s,
                  " (cancelled)" if st.cancelled else "")
        self.publish(rec.name, "compress", "cancelled" if st.cancelled else "done",
                     stored_bytes=stored_bytes, stored_pages=st.stored_pages,
                     resident_pages=st.resident_pages, duration_s=round(st.total_s, 6))
        return {"name": rec.name, "resident_pages": st.resident_pages, "stored_pages": st.stored_pages,
                "raw_pages": st.raw_pages, "pages": st.pages_by_kind, "bytes": st.bytes_by_kind,
                "hot_pages": st.hot_pages, "mapped_pages": st.mapped_pages, "scan_s": st.scan_s,
                "encode_s": st.encode_s, "punch_s": st.punch_s, "total_s": st.total_s,
                "cancelled": st.cancelled, "unchanged_pages": st.unchanged_pages,
                "raw_untried_pages": st.raw_untried_pages,
                "budget_stopped": st.budget_stopped, "left_pages": st.left_pages, "stored_bytes": stored_bytes,
                "resident_bytes": resident_bytes, "tries": st.tries, "cpu_s": cpu_s}

    def note_call(self, name: str, argv: list[str], stdin: bytes | None, kind: str | None) -> int | None:
        """A tool call starts in this sandbox: its kind (daemon/callkinds.py), noted for the
        phase; None when the manager does not serve the sandbox's memory."""
        mem = self.mem.get(name)
        return None if mem is None else mem.calls.note(argv, stdin, kind)

    def note_call_end(self, name: str, call: int | None, call_s: float, wake_s: float | None = None) -> None:
        """The tool call of kind ``call`` ran ``call_s`` in the guest, its vCPUs waiting
        ``wake_s`` for a CPU each time they got one (None: not known): a prefetch for the next
        call of that kind weighs its pages against that (callkinds.prefetch_pays)."""
        mem = self.mem.get(name)
        if mem is not None:
            mem.calls.note_end(call, call_s, wake_s)

    def refill(self, name: str, call: int | None) -> dict[str, Any]:
        """A tool call of kind ``call`` starts in a running sandbox (its wait was too short to
        compress it, or the compression was cancelled): the pages of that kind that trims
        dropped come back first, the vCPUs running. {} when there is nothing to predict."""
        mem = self.mem.get(name)
        if mem is None or mem.compressed or call is None:
            return {}
        try:
            st = mem.prefetch(hot=True, call=call)
        except (StoreError, RestoreError) as exc:
            # A prediction, not a duty: the fault path serves (or reports) those pages.
            log.warning("%s: pages of the coming tool call not put back: %s", name, exc)
            return {}
        if not st.prefetched_pages:
            return {}
        return {"prefetched_pages": st.prefetched_pages, "prefetch_s": st.prefetch_s, "resume_s": st.total_s}

    def prefetch(self, name: str, *, hot: bool, call: int | None = None, part: str = "all") -> dict[str, Any]:
        """A compressed sandbox's hot set back (before its vCPUs continue), for a tool call of
        kind ``call`` if one resumes it; {} when it is not compressed. ``part``: "early" and
        "rest" split it around the vCPUs' continue (SandboxMemory.prefetch); the rest's event
        counts both."""
        mem = self.mem.get(name)
        if mem is None or not mem.compressed:
            return {}
        t0 = time.perf_counter()
        try:
            st = mem.prefetch(hot=hot, call=call, part=part)
        except BaseException as exc:
            self.publish(name, "resume", "failed", reason=f"{type(exc).__name__}: {exc}",
                         duration_s=round(time.perf_counter() - t0, 6))
            raise
        if part == "early":
            return {"prefetched_pages": st.prefetched_pages, "prefetch_s": st.prefetch_s}
        durations.RESTORE_SECONDS.observe(st.total_s)
        # Its vCPUs continue next (the lifecycle's part): libvirt's own "resumed" event.
        self.publish(name, "resume", "done", duration_s=round(st.total_s, 6), prefetched_pages=st.prefetched_pages,
                     prefetched_bytes=st.prefetched_pages * PAGE_SIZE, left_pages=st.left_pages,
                     present_pages=st.present_pages)
        self.restore_count[name] = self.restore_count.get(name, 0) + 1
        return {"prefetched_pages": st.prefetched_pages, "prefetch_s": st.prefetch_s,
                "prefetch_mib_s": st.prefetch_mib_s}

    def prefetch_beside(self, name: str, *, hot: bool, call: int | None = None,
                        part: str = "all") -> Future[dict[str, Any]]:
        """``prefetch`` in a helper thread, for a sandbox whose vCPUs run already (a tool call's
        resume): a page the guest touches first is served by its fault and skipped here. A
        page the store cannot produce fails the sandbox, as before its vCPUs would have
        continued, and the Future raises it; any other failure is logged: first touch serves
        what is left."""
        def run() -> dict[str, Any]:
            try:
                out = self.prefetch(name, hot=hot, call=call, part=part)
            except (StoreError, PageUnavailable) as exc:
                if self.on_failed is not None:
                    self.on_failed(name, unrestorable_reason(exc))
                raise
            except Exception as exc:  # noqa: BLE001 - the call goes on; its faults tell
                log.warning("%s: hot set not put back beside the call (first touch serves it): %s: %s",
                            name, type(exc).__name__, exc)
                return {}
            crash_point("after-prefetch")
            return out
        with self._beside_lock:
            if self._beside is None:
                self._beside = ThreadPoolExecutor(max_workers=BESIDE_THREADS, thread_name_prefix="azq-resume",
                                                  initializer=threads.name_os_thread)
            return self._beside.submit(run)

    def memstats(self, name: str, *, reset: bool) -> dict[str, Any]:
        mem = self.mem.get(name)
        if mem is None:
            raise ConfigError(f"{name!r}: the manager does not serve its memory "
                              "(an eager clone that was never compressed)")
        return mem.memstats(reset=reset)

    def close(self) -> None:
        """Stop serving faults without unregistering: QEMU keeps its uffd, so a compressed
        guest waits for the next manager instead of reading zero pages."""
        if self._beside is not None:
            self._beside.shutdown(wait=True)
        self.supervisor.stop()
        for mem in list(self.mem.values()):
            mem.handler.stop()
        if self._store is not None:
            self._store.flush()
