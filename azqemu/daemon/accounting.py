"""Accounting: what the host spends on each sandbox (DESIGN.md, benchmark definitions).

Resident bytes (guest RAM the host holds for one sandbox alone), stored bytes (its part of
the page store), owned bytes (both, with its share of what is shared) and QEMU's own memory
apart; ``azq list``, ``azq dominfo``, the scheduler's pressure ablation and the density
benchmark (``owned``) read them here. Reads of the host go through ``azqemu.host``.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict
from typing import Any, cast

import psutil

from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.errors import AzqemuError, DomainNotFound
from azqemu.host import memacct, pagemap, procfs, schedstat, selfmem, threads
from azqemu.memory.accounting import OwnedBytes
from azqemu.pages import PAGE_SIZE
from azqemu.virt.clones import SandboxRecord
from azqemu.virt.host import Domain

# Reading a process's smaps walks all its mappings (4 ms for a QEMU here, with its ~450
# mappings printed and parsed): QEMU's own PSS is read again only this often per sandbox (at
# 10 s it was still 7.7 of the 18.8 s the density benchmark's sampling cost the manager at 16
# sandboxes, py-spy, session 12). Between two reads the figure follows QEMU's anonymous memory
# outside guest RAM (RssAnon minus the RAM's copies: a counter), where TCG's translation cache
# grows: a stale figure had put up to 400 MiB of it into the first minute's host cost.
QEMU_OWN_REFRESH_S = 30.0
# The manager's memory in ``ping`` (azq daemon status) is at most this old.
MANAGER_MEMORY_MAX_AGE_S = 1.0
# A compressed sandbox's copies are counted again at least this often even when nothing that
# the manager sees moved (``_still_copies``): QEMU's own threads may write guest RAM while the
# vCPUs are stopped (a device finishing a request), which no counter here shows.
STILL_COPIES_MAX_AGE_S = 30.0


class Accounting:
    def __init__(self, registry: Registry, memory: MemoryService) -> None:
        self.reg = registry
        self.memory = memory
        # name -> (QEMU pid, when its PSS was read, own bytes then, anonymous bytes outside RAM then)
        self._qemu_own_cache: dict[str, tuple[int, float, int, int | None]] = {}
        self._manager_memory_cache: tuple[float, dict[str, int]] | None = None
        self._ram_range: dict[str, tuple[int, int, int]] = {}     # name -> (QEMU pid, start, end)
        self._ram_fd: dict[str, tuple[int, str, str]] = {}        # name -> (QEMU pid, /proc/PID/fd/N, its target)
        # name -> (what must not move, when counted, the counts): compressed sandboxes' copies
        self._still: dict[str, tuple[tuple[int, ...], float, dict[str, int]]] = {}
        self._vcpu_tids: dict[str, tuple[int, list[int]]] = {}     # name -> (QEMU pid, its vCPU threads)
        registry.on_forget.append(self.forget)

    def qemu_pid(self, name: str) -> int | None:
        return self.reg.host.qemu_pid(name)

    def resident_bytes(self, name: str) -> int | None:
        """Guest RAM the host holds for ``name`` alone (None: no such sandbox running). Read
        as ``owned`` reads it, through the RAM's fd or range found once per QEMU process: the
        pressure ablation asks for every sandbox at each scheduler tick."""
        try:
            rec = self.reg.record(name)
            pid = self.qemu_pid(name)
            if pid is None:
                return None
            if rec.ram_mode == "cow":
                start, end = self._cow_ram(name, pid)
                return pagemap.anon_page_counts(pid, start, (end - start) // PAGE_SIZE)[0] * PAGE_SIZE
            return self._memfd_resident_bytes(name, pid)
        except Exception:  # noqa: BLE001 - an unknown sandbox, or a domain stopping while read
            return None

    def domain_resident_bytes(self, dom: Domain, ram_mode: str) -> int | None:
        """Guest RAM the host holds for this sandbox alone: the memfd's allocated pages, or
        for a copy-on-write clone the anonymous (copied) pages of its RAM mapping."""
        pid = dom.qemu_pid()
        if pid is None:
            return None
        try:
            return self.ram_resident_bytes(pid, ram_mode)
        except Exception:  # noqa: BLE001 - a domain stopping while listed
            return None

    @staticmethod
    def ram_resident_bytes(pid: int, ram_mode: str) -> int:
        """The host read behind ``domain_resident_bytes`` (procfs; raises when QEMU is gone)."""
        if ram_mode == "cow":
            start, end = procfs.find_guest_ram(pid, backing="ram.img")
            return pagemap.anon_page_counts(pid, start, (end - start) // PAGE_SIZE)[0] * PAGE_SIZE
        return os.stat(procfs.find_ram_fd(pid)).st_blocks * 512

    @staticmethod
    def read_host_mm() -> tuple[memacct.KsmStat, dict[str, int]]:
        """KSM's counters and zram's totals: the host-wide part of a copy-on-write clone's
        owned bytes (a dozen sysfs reads: once per sampling of all sandboxes, not per sandbox)."""
        return memacct.read_ksm(), memacct.read_zram_total()

    def _cow_ram(self, name: str, pid: int) -> tuple[int, int]:
        """The hva range of a copy-on-write clone's RAM mapping, found in /proc/PID/maps once per
        QEMU process (~1.5 ms a read): it does not move while the process lives."""
        cached = self._ram_range.get(name)
        if cached is not None and cached[0] == pid:
            return cached[1], cached[2]
        start, end = procfs.find_guest_ram(pid, backing="ram.img")
        self._ram_range[name] = (pid, start, end)
        return start, end

    def _memfd_resident_bytes(self, name: str, pid: int) -> int:
        """A memfd clone's guest RAM pages allocated: its memfd's st_blocks, through the QEMU fd
        found once per QEMU process (listing QEMU's ~90 open files and reading their links:
        0.14 ms a sandbox, at every 1 Hz sample of a density run; QEMU holds its RAM backend's
        file open as long as it runs). The link is read again at each use: an fd number that
        named something else would be looked up afresh."""
        cached = self._ram_fd.get(name)
        if cached is not None and cached[0] == pid:
            with contextlib.suppress(OSError):
                if os.readlink(cached[1]) == cached[2]:
                    return os.stat(cached[1]).st_blocks * 512
        path = procfs.find_ram_fd(pid)
        target = os.readlink(path)
        blocks = os.stat(path).st_blocks
        self._ram_fd[name] = (pid, str(path), target)
        return blocks * 512

    def _cow_ram_figures(self, name: str, pid: int, ksm: memacct.KsmStat) -> tuple[dict[str, int], bool]:
        """The smaps fields of a copy-on-write clone's RAM that ``memacct.linux_owned_bytes`` reads
        (Anonymous, KSM, Swap), and whether they came from smaps (with Pss and the rest).

        While KSM holds no page anywhere no mapping has a KSM page, and the anonymous and
        swapped copies are counted by PAGEMAP_SCAN of the RAM range alone (0.3 ms against 4 ms
        for smaps, which prints all of QEMU's ~450 mappings: the largest CPU cost of a density
        run's sampling at 16 sandboxes). Otherwise smaps, which counts KSM pages."""
        start, end = self._cow_ram(name, pid)
        if ksm.pages_shared == 0 and ksm.pages_sharing == 0:
            # Taken before the scan: a change while it runs shows at the next call.
            still = self._still_copies(name, pid)
            cached = self._still.get(name)
            now = time.monotonic()
            if still is not None and cached is not None and cached[0] == still and now - cached[1] < STILL_COPIES_MAX_AGE_S:
                return dict(cached[2]), False
            present, swapped = pagemap.anon_page_counts(pid, start, (end - start) // PAGE_SIZE)
            figures = {"Anonymous": present * PAGE_SIZE, "Swap": swapped * PAGE_SIZE, "KSM": 0}
            if still is not None:
                self._still[name] = (still, now, figures)
            else:
                self._still.pop(name, None)
            return dict(figures), False
        return procfs.read_vma_smaps(pid, start, end), True

    def _still_copies(self, name: str, pid: int) -> tuple[int, ...] | None:
        """For a compressed copy-on-write sandbox, what would move if its RAM's anonymous
        copies could have changed since they were counted; None for any other (counted at each
        read). Its guest is paused: only a vCPU that ran (their run time, /proc schedstat), a
        fault the manager served, or a compression or resume since (which leaves the state)
        changes them. The density benchmark reads every sandbox each second and a scan walks
        the whole RAM range's page tables, template pages mapped back included: 79% of the
        manager's CPU for it at 16 compressed sandboxes, ~1 ms each (session 40)."""
        mem = self.memory.get(name)
        if mem is None or not mem.compressed or self.reg.state_of(name)[0] != "compressed":
            return None
        cached = self._vcpu_tids.get(name)
        tids = cached[1] if cached is not None and cached[0] == pid else []
        ran = schedstat.wait_of(pid, tids) if tids else None
        if ran is None:     # not listed yet for this QEMU, or a thread went: listed again
            tids = threads.threads_named(pid, schedstat.VCPU_THREAD_PREFIX, prefix=True)
            self._vcpu_tids[name] = (pid, tids)
            ran = schedstat.wait_of(pid, tids)
            if ran is None:
                return None
        return (pid, id(mem), self.memory.compress_count.get(name, 0), mem.handler.fault_count(), ran.run_ns)

    def describe(self, rec: SandboxRecord) -> dict[str, Any]:
        """One row of ``azq list``: the record, the lifecycle state (``state``: running,
        compressed, failed ...; daemon/states.py) and why it failed (``failed_reason``), the
        domain's own state as libvirt says it (``domain_state``) and the memory it holds."""
        d = asdict(rec)
        d["state"], d["failed_reason"] = self.reg.state_of(rec.name)
        try:
            dom = self.reg.host.get_domain(rec.name)
            d["domain_state"] = dom.state()
            d["qemu_pid"] = dom.qemu_pid()
            d["resident_bytes"] = self.domain_resident_bytes(dom, rec.ram_mode)
        except DomainNotFound:
            d.update(domain_state="gone", qemu_pid=None, resident_bytes=None)
        mem = self.memory.get(rec.name)
        d["stored_bytes"] = mem.stored_bytes() if mem is not None else 0
        d["compressed"] = bool(mem is not None and mem.compressed)
        return d

    def dominfo(self, name: str) -> dict[str, Any]:
        """``describe`` plus the template's machine (memory, vCPUs, machine type, accelerator)."""
        rec = self.reg.record(name)
        d = self.describe(rec)
        templates = self.reg.templates
        tmpl = templates.get(rec.template) if templates.exists(rec.template) else None
        if tmpl:
            d.update(mem_mib=tmpl.mem_mib, vcpus=tmpl.vcpus, machine=tmpl.machine, accel=tmpl.accel)
        d["manager_memory"] = self.manager_memory()
        return d

    def owned(self, name: str, store_overhead: float = 1.0,
              host_mm: tuple[memacct.KsmStat, dict[str, int]] | None = None,
              books: dict[str, OwnedBytes] | None = None) -> dict[str, Any]:
        """What the host spends on this sandbox alone (DESIGN.md, benchmark definitions).

        memfd clones (none, agentzip*): the RAM memfd's allocated pages plus the sandbox's
        bytes in the page store (private encoded pages, its share of shared blobs, its index),
        times ``store_overhead`` (the arenas' dead bytes, shared out pro rata).
        Copy-on-write clones (none-cow, linux): the private anonymous pages of the RAM mapping,
        minus what KSM merged plus the sandbox's share of merged pages, plus its share of
        zram's memory for what was swapped out. Template pages only mapped are the template's.
        QEMU's own memory (process PSS minus guest RAM) is reported apart. ``host_mm``: KSM's
        and zram's host-wide figures (``read_host_mm``), read once for many sandboxes; ``books``
        the store's (``PageStore.owned_bytes_many``), likewise.
        """
        rec = self.reg.record(name)
        pid = self.qemu_pid(name)
        out: dict[str, Any] = {"name": name, "policy": rec.policy, "ram_mode": rec.ram_mode}
        if pid is None:
            return out | {"owned_bytes": 0, "resident_bytes": 0, "stored_bytes": 0, "qemu_own_bytes": 0}
        mem = self.memory.get(name)
        vma: dict[str, int] | None = None
        if rec.ram_mode == "cow":
            ksm, zram = host_mm if host_mm is not None else self.read_host_mm()
            figures, from_smaps = self._cow_ram_figures(name, pid, ksm)
            vma = figures if from_smaps else None        # qemu_own_bytes needs its Pss
            owned: float = memacct.linux_owned_bytes(figures, ksm, zram)
            resident = figures.get("Anonymous", 0)
            stored: float = owned - max(0, resident - figures.get("KSM", 0))
            if mem is not None:  # compressed by azqemu: its pages in the store too
                in_store = mem.stored_bytes(books) * store_overhead
                stored += in_store
                owned += in_store
        else:
            # fstat of the memfd and the store's books: cheap enough to sample often.
            try:
                resident = self._memfd_resident_bytes(name, pid)
            except (OSError, AzqemuError):      # QEMU stopping while sampled
                resident = 0
            stored = mem.stored_bytes(books) * store_overhead if mem is not None else 0.0
            owned = resident + stored
        return out | {"owned_bytes": int(owned), "resident_bytes": int(resident), "stored_bytes": int(stored),
                      "qemu_own_bytes": self.qemu_own_bytes(name, pid, rec.ram_mode, vma,
                                                            ram_anon_bytes=int(resident) if rec.ram_mode == "cow" else 0),
                      "compress_s_total": mem.compress_s_total if mem else 0.0,
                      "compress_cpu_s_total": self.memory.compress_cpu_s.get(name, 0.0),
                      "compress_cpu_loops_below_s_total": self.memory.compress_cpu_loops_below_s.get(name, 0.0),
                      "compress_encoded_bytes_total": self.memory.compress_encoded_bytes.get(name, 0),
                      "restore_s_total": mem.restore_s_total if mem else 0.0}

    def qemu_own_bytes(self, name: str, pid: int, ram_mode: str, vma: dict[str, int] | None,
                       ram_anon_bytes: int = 0) -> int:
        """QEMU's memory minus guest RAM: its PSS read every QEMU_OWN_REFRESH_S, moved in
        between by the change of its anonymous memory outside guest RAM (``ram_anon_bytes``:
        the RAM's anonymous copies now; a memfd's RAM is shared memory, never anonymous)."""
        now = time.monotonic()
        try:
            anon_outside = procfs.read_rss_anon(pid) - ram_anon_bytes
        except (OSError, AzqemuError):
            anon_outside = None
        cached = self._qemu_own_cache.get(name)
        if cached is not None and cached[0] == pid and now - cached[1] < QEMU_OWN_REFRESH_S:
            then = cached[3]
            moved = anon_outside - then if anon_outside is not None and then is not None else 0
            return max(0, cached[2] + moved)
        if vma is None:
            start, end = (self._cow_ram(name, pid) if ram_mode == "cow"
                          else procfs.find_guest_ram(pid, backing="memfd:"))
            vma = procfs.read_vma_smaps(pid, start, end)
        value = memacct.qemu_own_bytes(procfs.read_smaps_rollup(pid), vma)
        self._qemu_own_cache[name] = (pid, now, value, anon_outside)
        return value

    def domstats(self, name: str) -> dict[str, Any]:
        """``azq domstats``: one sandbox's figures in one row, as ``virsh domstats`` gives a
        domain's: its state and phase, owned/resident/stored bytes, the fault handler's
        counters, and how often and how long it was compressed and restored."""
        rec = self.reg.record(name)
        state, reason = self.reg.state_of(name)
        try:
            domain_state = self.reg.host.get_domain(name).state()
        except DomainNotFound:
            domain_state = "gone"
        st = self.reg.sched.get(name)
        out: dict[str, Any] = {"name": name, "state": state, "failed_reason": reason,
                               "domain_state": domain_state, "policy": rec.policy, "ram_mode": rec.ram_mode,
                               "phase": st.tracker.current().phase if st is not None else None}
        own = self.owned(name) if domain_state != "gone" else {}
        for k in ("owned_bytes", "resident_bytes", "stored_bytes", "qemu_own_bytes",
                  "compress_s_total", "restore_s_total"):
            out[k] = own.get(k, 0)
        mem = self.memory.get(name)
        # memstats() is typed dict[str, object]: its "handler" entry is the counters' dict.
        handler = cast(dict[str, Any], mem.memstats(reset=False)["handler"]) if mem is not None else {}
        out.update(compressed=bool(mem is not None and mem.compressed),
                   compress_count=self.memory.compress_count.get(name, 0),
                   restore_count=self.memory.restore_count.get(name, 0),
                   faults=int(handler.get("faults", 0)), faults_served=int(handler.get("served", 0)),
                   fault_errors=int(handler.get("errors", 0)))
        return out

    def owned_all(self, names: list[str] | None = None) -> dict[str, Any]:
        """Owned bytes of sandboxes (all by default), the store's total and the manager's
        memory: its RSS, and its parts (``manager_memory``): anon is the manager's own; file
        and shmem are shared page cache it maps (the template images, its code)."""
        if names is None:
            names = [r.name for r in self.reg.sandboxes.list()]
            self._forget_all_but(set(names))
        # The store's arenas as tmpfs holds them (dead bytes not yet punched or compacted
        # included): host memory. Those dead bytes are nobody's, so every sandbox's store
        # bytes carry their share of them (pro rata): owned figures hide nothing.
        store_bytes, store_live, overhead = 0, 0, 1.0
        store = self.memory.opened_store()
        books: dict[str, OwnedBytes] = {}
        if store is not None:
            tb, books = store.books(names)
            store_bytes, store_live = int(tb.arena_allocated_bytes), int(tb.arena_live_bytes)
            overhead = tb.dead_overhead
        rows = {}
        host_mm = self.read_host_mm()
        for n in names:
            try:
                rows[n] = self.owned(n, store_overhead=overhead, host_mm=host_mm, books=books)
            except AzqemuError as exc:
                rows[n] = {"name": n, "error": str(exc)}
        return {"sandboxes": rows, "store_bytes": store_bytes, "store_live_bytes": store_live,
                "manager_rss_bytes": psutil.Process().memory_info().rss,
                "manager_memory": self.manager_memory()}

    def forget(self, name: str) -> None:
        """Drop the per-process caches of a sandbox that went away (the registry calls this):
        a daemon that runs for weeks sees many names come and go."""
        for cache in (self._ram_range, self._ram_fd, self._qemu_own_cache, self._still, self._vcpu_tids):
            cache.pop(name, None)

    def _forget_all_but(self, names: set[str]) -> None:
        """Drop the caches of names no record has (a sandbox forgotten while it was being read,
        or left from before a restart). The keys are copied first: a sampler thread may add
        one meanwhile."""
        for cache in (self._ram_range, self._ram_fd, self._qemu_own_cache, self._still, self._vcpu_tids):
            for gone in [n for n in list(cache) if n not in names]:
                cache.pop(gone, None)

    def manager_memory_cached(self, max_age_s: float = MANAGER_MEMORY_MAX_AGE_S) -> dict[str, int]:
        """``manager_memory`` read again at most every ``max_age_s`` (for ``ping``, which
        clients call often: the store's books are walked per domain)."""
        now = time.monotonic()
        cached = self._manager_memory_cache
        if cached is None or now - cached[0] >= max_age_s:
            cached = self._manager_memory_cache = (now, self.manager_memory())
        return cached[1]

    def manager_memory(self) -> dict[str, int]:
        """The manager's own memory and its parts (``azq daemon status --json``, ``azq
        dominfo``, the density benchmark). From the kernel (/proc/self/status): ``rss_bytes``
        = ``anon_bytes`` (its own) + ``file_bytes`` + ``shmem_bytes`` (shared page cache it
        maps: the template images, the store's arenas, its code). From glibc (mallinfo2):
        ``heap_bytes`` / ``heap_in_use_bytes`` / ``heap_free_bytes`` (free but held, the
        address range at least) / ``mmapped_bytes``. From its own books: ``store_index_bytes``
        (the page store's metadata of the sandboxes attached: blob rows, duplicate and
        similarity entries, sandbox indices), ``template_index_bytes`` (hashes and lookups of
        the template images it holds), ``sandbox_state_bytes`` (per-sandbox state: source
        maps, fault handlers' maps and rings, hot sets per kind of call, trim history) over
        ``sandboxes``, ``kind_book_bytes`` (the kinds of call per sharing domain)."""
        out = dict(selfmem.self_memory())
        out.update(selfmem.heap_stats())
        mems = list(self.memory.mem.values())
        out["sandboxes"] = len(mems)
        out["sandbox_state_bytes"] = sum(m.state_bytes() for m in mems)
        out["kind_book_bytes"] = sum(b.nbytes for b in list(self.memory.kind_books.values()))
        out["template_index_bytes"] = sum(t.index_bytes for t in self.memory.loaded_templates() if not t.closed)
        store = self.memory.opened_store()
        index = 0
        if store is not None:
            for domain in {m.sharing_domain for m in mems}:
                try:
                    db = store.domain_bytes(domain)
                except (KeyError, AzqemuError):
                    continue
                index += db.blob_bytes - db.payload_bytes + db.index_bytes
        out["store_index_bytes"] = int(index)
        return out
