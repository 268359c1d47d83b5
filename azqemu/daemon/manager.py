"""The manager: the daemon's state and every operation the CLI can ask for.

Each public method ``op_<name>`` is one protocol operation; arguments arrive as JSON values.
libvirt is the truth about which sandboxes run: at start the manager reconciles its records
with libvirt's domains (records of vanished domains are dropped, running sandboxes without a
record get one back from their domain metadata, half-made templates are removed), so a
restarted daemon lists and serves the same sandboxes.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from azqemu import config as config_mod
from azqemu import doctor
from azqemu.agent import GuestAgent
from azqemu.errors import (
    AgentTimeout,
    AzqemuError,
    ConfigError,
    DomainNotFound,
    DomainStateError,
    SandboxExists,
    SandboxNotFound,
    StoreCorrupt,
    StoreForeign,
)
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
from azqemu.sandboxes import (
    DEFAULT_SHARING_DOMAIN,
    SandboxRecord,
    SandboxRepo,
    clone_one,
    cow_fill,
    destroy,
    eager_fill,
)
from azqemu.sandboxmem import SandboxMemory
from azqemu.sched import policy as policy_mod
from azqemu.sched.agent_channel import AgentMessage
from azqemu.sched.agentlink import AgentLinks
from azqemu.sched.scheduler import SchedState, Scheduler
from azqemu.templates import TemplateMeta, TemplateRepo, create_template, validate_name, warmup_from_cli
from azqemu.virt import ramfile
from azqemu.virt.host import Domain, Host
from azqemu.virt.identity import Identity, remove_vm_dir

log = logging.getLogger(__name__)

# Clones start in parallel, bounded: each start costs libvirt and QEMU a few hundred ms of
# CPU. Measured here (2 cores, TCG, azq bench clone -n 16): 4 at once gave a median of
# 1.06 s per clone and 4.8 s in all, 2 at once 0.56 s and 4.6 s: more only queues.
MAX_PARALLEL_CLONES = 2
MAX_CLONES_PER_REQUEST = 256
EXEC_DEFAULT_TIMEOUT_S = 300.0
QEMU_OWN_REFRESH_S = 10.0


class Manager:
    def __init__(self, cfg: config_mod.Config | None = None) -> None:
        self.cfg = cfg or config_mod.load()
        self.host = Host(self.cfg.libvirt_uri)
        self.templates = TemplateRepo(self.cfg)
        self.sandboxes = SandboxRepo(self.cfg)
        self._locks: dict[str, threading.RLock] = defaultdict(threading.RLock)
        self._locks_guard = threading.Lock()
        self._template_lock = threading.Lock()
        self.started_at = time.time()
        self._store: PageStore | None = None
        self._store_lock = threading.Lock()
        self._template_images: dict[str, TemplateImage] = {}
        self.mem: dict[str, SandboxMemory] = {}
        self.sched: dict[str, SchedState] = {}
        # Sandboxes azqemu itself paused (compressed): a tool call resumes them; a sandbox the
        # user paused stays paused and exec refuses it.
        self.paused_by_azq: set[str] = set()
        self._qemu_own_cache: dict[str, tuple[int, float, int]] = {}
        mode, why = doctor.restore_mode()
        self.lazy_available = mode == "lazy"
        log.info("restore mode: %s (%s)", mode, why)
        self.reconcile()
        self.scheduler = Scheduler(self)
        self.agent_links = AgentLinks(self._agent_sockets, self._on_agent_message)

    def start(self) -> None:
        """Start the background work: the scheduler and the in-guest agent links."""
        self.scheduler.start()
        self.agent_links.start()

    # -- bookkeeping ---------------------------------------------------------------------
    def lock(self, name: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks[name]

    def reconcile(self) -> dict[str, list[str]]:
        """Make records agree with libvirt; returns what changed."""
        report: dict[str, list[str]] = {"kept": [], "dropped": [], "adopted": [], "removed": []}
        self.templates.remove_stale_builds()
        running = {}
        for dom in self.host.domains():
            meta = dom.metadata()
            if meta.get("state-dir", str(self.cfg.state_dir)) != str(self.cfg.state_dir):
                continue  # another manager's sandbox (another state directory)
            if meta.get("role") == "template-build":
                # A template build whose manager died: its work dir is gone, so is its use.
                with contextlib.suppress(Exception):
                    dom.destroy()
                remove_vm_dir(dom.name)
                report["removed"].append(dom.name)
            elif meta.get("role") == "sandbox":
                running[dom.name] = (dom, meta)
        for rec in self.sandboxes.list():
            if rec.name in running:
                report["kept"].append(rec.name)
            else:
                self.sandboxes.remove(rec.name)
                remove_vm_dir(rec.name)
                report["dropped"].append(rec.name)
        for name, (dom, meta) in running.items():
            if meta.get("ram-mode") == "lazy" or self._store_has(name):
                try:
                    self._attach_memory(name, meta.get("sharing-domain", DEFAULT_SHARING_DOMAIN),
                                        self.templates.get(meta.get("template", "")),
                                        lazy_clone=meta.get("ram-mode") == "lazy")
                except AzqemuError as exc:
                    log.error("cannot reattach the memory of %s: %s", name, exc)
            if self.sandboxes.path(name).exists():
                rec = self.sandboxes.get(name)
                self.sched[name] = SchedState(policy_mod.get(rec.policy), grace_s=rec.grace_s)
                if dom.state() == "paused" and name in self.mem and self.mem[name].compressed:
                    self.paused_by_azq.add(name)
            if not self.sandboxes.path(name).exists():
                self.sched[name] = SchedState(policy_mod.get("manual"))
                self.sandboxes.save(SandboxRecord(
                    name=name, template=meta.get("template", "?"),
                    sharing_domain=meta.get("sharing-domain", DEFAULT_SHARING_DOMAIN),
                    ram_mode=meta.get("ram-mode", "eager"), uuid=dom.uuid, created_at=time.time()))
                report["adopted"].append(name)
        log.info("reconciled with libvirt: %s", report)
        return report

    # -- memory -------------------------------------------------------------------------
    @property
    def store(self) -> PageStore:
        with self._store_lock:
            if self._store is None:
                root = self.cfg.shm_dir / "store"
                try:
                    self._store = PageStore(root)
                except (StoreForeign, StoreCorrupt) as exc:
                    # Refuse to guess while a running sandbox may have pages in it; otherwise
                    # (a store of an older azqemu, a crash before any sandbox ran) start over.
                    if self.sandboxes.list():
                        raise
                    stale = root.with_name(f"store.unreadable-{int(time.time())}")
                    log.warning("%s; no sandbox uses it: moved to %s, starting a new store", exc, stale)
                    os.rename(root, stale)
                    shutil.rmtree(stale, ignore_errors=True)
                    self._store = PageStore(root)
            return self._store

    def _store_has(self, name: str) -> bool:
        root = self.cfg.shm_dir / "store"
        return root.exists() and name in self.store.sandboxes()

    def template_image(self, tmpl: TemplateMeta) -> TemplateImage:
        with self._store_lock:
            img = self._template_images.get(tmpl.name)
            if img is None:
                img = TemplateImage(self.templates.ram_path(tmpl.name))
                self._template_images[tmpl.name] = img
            return img

    def _attach_memory(self, name: str, sharing_domain: str, tmpl: TemplateMeta, *,
                       lazy_clone: bool, use_siblings: bool = True) -> SandboxMemory:
        mem = SandboxMemory(name, sharing_domain, uffd_socket=self.cfg.run_dir / "vm" / name / "uffd.sock",
                            store=self.store, template=self.template_image(tmpl),
                            template_ram=self.templates.ram_path(tmpl.name), lazy_clone=lazy_clone,
                            use_siblings=use_siblings)
        if lazy_clone or self._store_has(name):
            mem.attach()
        self.mem[name] = mem
        return mem

    def _agent_sockets(self) -> dict[str, Path]:
        return {n: self.cfg.run_dir / "vm" / n / "azq-agent.sock" for n in list(self.sched)}

    def _on_agent_message(self, name: str, msg: AgentMessage) -> None:
        st = self.sched.get(name)
        if st is not None:
            st.tracker.agent_event(msg.phase)

    def qemu_pid(self, name: str) -> int | None:
        try:
            return self.host.get_domain(name).qemu_pid()
        except AzqemuError:
            return None

    def resident_bytes(self, name: str) -> int | None:
        try:
            rec = self._record(name)
            return self._resident_bytes(self.host.get_domain(name), rec.ram_mode)
        except AzqemuError:
            return None

    def _release_memory(self, name: str) -> None:
        mem = self.mem.pop(name, None)
        if mem is not None:
            mem.detach()
        if self._store_has(name):
            self.store.free_sandbox(name)
            self.store.flush()

    def _record(self, name: str) -> SandboxRecord:
        return self.sandboxes.get(name)

    def _domain(self, name: str) -> Domain:
        self._record(name)
        try:
            return self.host.get_domain(name)
        except DomainNotFound:
            raise SandboxNotFound(name) from None

    def clones_of(self, template: str) -> list[str]:
        return [r.name for r in self.sandboxes.list() if r.template == template]

    # -- operations ----------------------------------------------------------------------
    def op_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "started_at": self.started_at,
                "sandboxes": len(self.sandboxes.list())}

    def op_template_create(self, name: str, mem_mib: int = 512, vcpus: int = 1,
                           warmup: list[str] | None = None) -> dict[str, Any]:
        with self._template_lock:
            meta = create_template(self.host, self.templates, name, mem_mib=int(mem_mib),
                                   vcpus=int(vcpus), warmup=warmup_from_cli(tuple(warmup or ())),
                                   progress=lambda m: log.info("template %s: %s", name, m))
        return asdict(meta)

    def op_template_list(self) -> list[dict[str, Any]]:
        out = []
        for t in self.templates.list():
            d = asdict(t)
            d["clones"] = len(self.clones_of(t.name))
            out.append(d)
        return out

    def op_template_delete(self, name: str) -> None:
        with self._template_lock:
            self.templates.delete(name, self.clones_of(name))

    def op_clone(self, template: str, count: int = 1, name_prefix: str | None = None,
                 sharing_domain: str = DEFAULT_SHARING_DOMAIN, names: list[str] | None = None,
                 ram_mode: str | None = None, policy: str = "manual",
                 grace_s: float = policy_mod.DEFAULT_GRACE_S) -> list[dict[str, Any]]:
        pol = policy_mod.get(policy)
        tmpl = self.templates.get(template)
        count = int(count)
        if names:
            count = len(names)
        if not 1 <= count <= MAX_CLONES_PER_REQUEST:
            raise ConfigError(f"clone count {count} out of range (1-{MAX_CLONES_PER_REQUEST})")
        validate_name(sharing_domain, "sharing domain")
        prefix = name_prefix or f"{template}-"
        if not names:
            taken = {r.name for r in self.sandboxes.list()}
            names, i = [], 0
            while len(names) < count:
                cand = f"{prefix}{i}"
                if cand not in taken and not self.host.has_domain(cand):
                    names.append(cand)
                i += 1
        for n in names:
            validate_name(n, "sandbox name")
        mode = ram_mode or pol.clone_mode
        if mode == "lazy" and not self.lazy_available and not ram_mode:
            mode = "eager"  # the policy's choice where lazy clones are impossible (doctor says why)
        if mode not in ("eager", "lazy", "cow"):
            raise ConfigError(f"unknown RAM mode {mode!r} (eager, lazy, cow)")
        if mode == "lazy" and not self.lazy_available:
            raise ConfigError(f"lazy clones are not available here: {doctor.restore_mode()[1]}")
        env = self._preload_env(mode) if self.lazy_available else {}
        fills = {"eager": eager_fill, "cow": cow_fill}

        for n in names:
            # Refuse a taken name before anything is made (and never touch the existing one).
            if n in self.sched or self.sandboxes.path(n).exists() or self.host.has_domain(n):
                raise SandboxExists(n)
        attached: set[str] = set()

        def lazy_fill(_dom: Domain, _pid: int, ident: Identity, t: TemplateMeta) -> None:
            self._attach_memory(ident.name, sharing_domain, t, lazy_clone=True, use_siblings=pol.use_siblings)
            attached.add(ident.name)

        def one(n: str) -> SandboxRecord:
            with self.lock(n):
                try:
                    rec = clone_one(self.host, tmpl, n, sharing_domain=sharing_domain, ram_mode=mode,
                                    fill=fills.get(mode, lazy_fill), repo=self.sandboxes, env=env,
                                    ram_backing="file-private" if mode == "cow" else "memfd",
                                    policy=pol.name, grace_s=float(grace_s))
                    self.sched[n] = SchedState(pol, grace_s=float(grace_s))
                    return rec
                except BaseException:
                    if n in attached:  # only the memory this attempt attached
                        mem = self.mem.pop(n, None)
                        if mem is not None:
                            mem.detach()
                    raise

        with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_CLONES, len(names))) as pool:
            futures = [pool.submit(one, n) for n in names]
            results, first_error = [], None
            for f in futures:
                try:
                    results.append(asdict(f.result()))
                except Exception as exc:  # noqa: BLE001 - the first error is re-raised below
                    first_error = first_error or exc
        if first_error is not None:
            # All or nothing: a partly made batch is removed so no orphan remains.
            for r in results:
                with contextlib.suppress(Exception):
                    destroy(self.host, self.sandboxes, r["name"])
            raise first_error
        return results

    def _preload_env(self, mode: str) -> dict[str, str]:
        """The export library in QEMU (qemu:env); it waits silently until the manager asks.
        Copy-on-write clones map the template's ram.img privately (virt/cowhook.py)."""
        return {"LD_PRELOAD": str(self.cfg.preload_library),
                "AZQ_UFFD_SOCKET": "",  # per clone, filled in below
                "AZQ_UFFD_RAM_MATCH": "/ram.img" if mode == "cow" else "memory-backend-memfd"}

    def op_exec(self, name: str, argv: list[str], timeout_s: float = EXEC_DEFAULT_TIMEOUT_S,
                stdin_b64: str | None = None) -> dict[str, Any]:
        if not argv:
            raise ConfigError("no command given (azq exec SANDBOX -- CMD ...)")
        t0 = time.monotonic()
        dom = self._domain(name)
        st = self.sched.get(name)
        if st is not None:
            st.tracker.exec_started()  # from now on the scheduler leaves this sandbox alone
        try:
            mem = self.mem.get(name)
            if mem is not None:
                mem.cancel()  # a compression in progress stops at its next step
            resume: dict[str, Any] = {}
            # Under the lock: a compression that already passed its last phase check may be
            # pausing the sandbox right now; once it is done (or cancelled) we see its mark.
            with self.lock(name):
                if name in self.paused_by_azq:
                    resume = self._resume_locked(name, dom, prefetch=st.policy.prefetch if st else True)
            state = dom.state()
            if state != "running":
                raise DomainStateError(name, state, "running")
            agent = GuestAgent(name, dom.agent_command)
            stdin = base64.b64decode(stdin_b64) if stdin_b64 else None
            res = agent.exec(argv, timeout_s=float(timeout_s), stdin=stdin)
        finally:
            if st is not None:
                st.tracker.exec_ended()
        return {"exit_code": res.exit_code, "stdout_b64": base64.b64encode(res.stdout).decode(),
                "stderr_b64": base64.b64encode(res.stderr).decode(), "duration_s": time.monotonic() - t0,
                "resume_s": resume.get("resume_s", 0.0), "prefetched_pages": resume.get("prefetched_pages", 0)}

    def op_phase(self, name: str, phase: str) -> dict[str, Any]:
        """An orchestrator's hint: 'wait' (the agent waits for its LLM) or 'tool' (a tool call
        is coming: a compressed sandbox is resumed with its hot set now, ahead of it)."""
        self._record(name)
        st = self.sched.get(name)
        if st is None:
            raise ConfigError(f"{name!r} has no scheduling state")
        try:
            st.tracker.hint(phase)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        out: dict[str, Any] = {"name": name, "phase": phase}
        if phase == "tool" and name in self.paused_by_azq:
            mem = self.mem.get(name)
            if mem is not None:
                mem.cancel()
            with self.lock(name):
                if name in self.paused_by_azq:
                    out.update(self._resume_locked(name, self._domain(name), prefetch=st.policy.prefetch))
        return out

    def op_set_policy(self, names: list[str], policy: str, grace_s: float | None = None,
                      pressure_budget_bytes: int | None = None) -> None:
        pol = policy_mod.get(policy)
        for n in names:
            rec = self._record(n)
            rec.policy = pol.name
            if grace_s is not None:
                rec.grace_s = float(grace_s)
            self.sandboxes.save(rec)
            self.sched[n] = SchedState(pol, grace_s=rec.grace_s)
        if pressure_budget_bytes is not None:
            self.scheduler.pressure_budget_bytes = int(pressure_budget_bytes) or None

    # -- what the scheduler calls ------------------------------------------------------------
    def compress_if_idle(self, name: str, st: SchedState) -> None:
        """Compress a sandbox that is still waiting for its LLM (the scheduler's call)."""
        with self.lock(name):
            if st.tracker.in_tool_call() or st.tracker.current().phase != "wait":
                return
            if name not in self.sched:
                return
            self._compress_locked(name)

    def compress_and_run_on(self, name: str) -> None:
        """The pressure ablation: compress, then let the sandbox run on, served lazily."""
        with self.lock(name):
            self._compress_locked(name)
            self._resume_locked(name, self._domain(name), prefetch=False)

    def pageout(self, name: str) -> None:
        """The linux policy's proactive reclaim: push an idle sandbox's RAM out to zram."""
        from azqemu.bench.linux_config import pageout

        pid = self.qemu_pid(name)
        if pid is not None:
            pageout(pid, backing="ram.img")

    def op_pause(self, name: str) -> None:
        with self.lock(name):
            dom = self._domain(name)
            if dom.state() != "paused":
                dom.suspend()

    def op_resume(self, name: str, prefetch: bool = True) -> dict[str, Any]:
        """Continue a sandbox; a compressed one gets its hot set back first."""
        mem = self.mem.get(name)
        if mem is not None:
            mem.cancel()  # a compression in progress stops at its next step
        with self.lock(name):
            dom = self._domain(name)
            return self._resume_locked(name, dom, prefetch=bool(prefetch))

    def _resume_locked(self, name: str, dom: Domain, *, prefetch: bool = True) -> dict[str, Any]:
        t0 = time.perf_counter()
        out: dict[str, Any] = {"prefetched_pages": 0, "prefetch_s": 0.0}
        mem = self.mem.get(name)
        if mem is not None and mem.compressed:
            st = mem.prefetch(hot=prefetch)
            out.update(prefetched_pages=st.prefetched_pages, prefetch_s=st.prefetch_s,
                       prefetch_mib_s=st.prefetch_mib_s)
        if dom.state() == "paused":
            dom.resume()
        self.paused_by_azq.discard(name)
        out["resume_s"] = time.perf_counter() - t0
        return out

    def op_compress(self, name: str) -> dict[str, Any]:
        """Pause the sandbox, encode its resident RAM into the store, punch it; stays paused."""
        with self.lock(name):
            return self._compress_locked(name)

    def _compress_locked(self, name: str) -> dict[str, Any]:
        """The caller holds the sandbox's lock."""
        rec = self._record(name)
        dom = self._domain(name)
        if not self.lazy_available:
            raise ConfigError(f"cannot compress {name!r}: {doctor.restore_mode()[1]}")
        if dom.state() == "running":
            self.paused_by_azq.add(name)
            dom.suspend()
        mem = self.mem.get(name)
        if mem is None:
            mem = self._attach_memory(name, rec.sharing_domain, self.templates.get(rec.template),
                                      lazy_clone=rec.ram_mode == "lazy",
                                      use_siblings=policy_mod.get(rec.policy).use_siblings)
        st = mem.compress()
        return {"name": name, "resident_pages": st.resident_pages, "stored_pages": st.stored_pages,
                "raw_pages": st.raw_pages, "pages": st.pages_by_kind, "bytes": st.bytes_by_kind,
                "hot_pages": st.hot_pages, "mapped_pages": st.mapped_pages, "scan_s": st.scan_s, "encode_s": st.encode_s,
                "punch_s": st.punch_s, "total_s": st.total_s, "cancelled": st.cancelled,
                "stored_bytes": mem.stored_bytes(), "resident_bytes": mem.resident_bytes()}

    def op_destroy(self, name: str) -> None:
        with self.lock(name):
            mem = self.mem.get(name)
            if mem is not None:
                # Unregister before the domain goes: a QEMU blocked on an unserved fault
                # makes libvirt's destroy hang for seconds.
                mem.cancel()
            self.sched.pop(name, None)
            self.paused_by_azq.discard(name)
            self._release_memory(name)
            destroy(self.host, self.sandboxes, name)

    def _resident_bytes(self, dom: Domain, ram_mode: str) -> int | None:
        """Guest RAM the host holds for this sandbox alone: the memfd's allocated pages, or
        for a copy-on-write clone the anonymous (copied) pages of its RAM mapping."""
        pid = dom.qemu_pid()
        if pid is None:
            return None
        try:
            if ram_mode == "cow":
                from azqemu.bench.hostmem import read_vma_smaps
                from azqemu.bench.linux_config import find_guest_ram

                start, end = find_guest_ram(pid, backing="ram.img")
                return read_vma_smaps(pid, start, end).get("Anonymous", 0)
            return os.stat(ramfile.find_ram_fd(pid)).st_blocks * 512
        except Exception:  # noqa: BLE001 - a domain stopping while listed
            return None

    def _describe(self, rec: SandboxRecord) -> dict[str, Any]:
        d = asdict(rec)
        try:
            dom = self.host.get_domain(rec.name)
            d["state"] = dom.state()
            d["qemu_pid"] = dom.qemu_pid()
            d["resident_bytes"] = self._resident_bytes(dom, rec.ram_mode)
        except DomainNotFound:
            d.update(state="gone", qemu_pid=None, resident_bytes=None)
        mem = self.mem.get(rec.name)
        d["stored_bytes"] = mem.stored_bytes() if mem is not None else 0
        d["compressed"] = bool(mem is not None and mem.compressed)
        return d

    def owned(self, name: str, store_overhead: float = 1.0) -> dict[str, Any]:
        """What the host spends on this sandbox alone (DESIGN.md, benchmark definitions).

        memfd clones (none, agentzip*): the RAM memfd's allocated pages plus the sandbox's
        bytes in the page store (private encoded pages, its share of shared blobs, its index),
        times ``store_overhead`` (the arenas' dead bytes, shared out pro rata).
        Copy-on-write clones (none-cow, linux): the private anonymous pages of the RAM mapping,
        minus what KSM merged plus the sandbox's share of merged pages, plus its share of
        zram's memory for what was swapped out. Template pages only mapped are the template's.
        QEMU's own memory (process PSS minus guest RAM) is reported apart.
        """
        from azqemu.bench import hostmem
        from azqemu.bench.linux_config import find_guest_ram

        rec = self._record(name)
        pid = self.qemu_pid(name)
        out: dict[str, Any] = {"name": name, "policy": rec.policy, "ram_mode": rec.ram_mode}
        if pid is None:
            return out | {"owned_bytes": 0, "resident_bytes": 0, "stored_bytes": 0, "qemu_own_bytes": 0}
        mem = self.mem.get(name)
        vma: dict[str, int] | None = None
        if rec.ram_mode == "cow":
            start, end = find_guest_ram(pid, backing="ram.img")
            vma = hostmem.read_vma_smaps(pid, start, end)
            owned: float = hostmem.linux_owned_bytes(vma, hostmem.read_ksm(), hostmem.read_zram_total())
            resident = vma.get("Anonymous", 0)
            stored: float = owned - max(0, resident - vma.get("KSM", 0))
            if mem is not None:  # compressed by azqemu: its pages in the store too
                in_store = mem.stored_bytes() * store_overhead
                stored += in_store
                owned += in_store
        else:
            # fstat of the memfd and the store's books: cheap enough to sample often.
            resident = self._resident_bytes(self.host.get_domain(name), rec.ram_mode) or 0
            stored = mem.stored_bytes() * store_overhead if mem is not None else 0.0
            owned = resident + stored
        return out | {"owned_bytes": int(owned), "resident_bytes": int(resident), "stored_bytes": int(stored),
                      "qemu_own_bytes": self._qemu_own_bytes(name, pid, rec.ram_mode, vma),
                      "compress_s_total": mem.compress_s_total if mem else 0.0,
                      "restore_s_total": mem.restore_s_total if mem else 0.0}

    def _qemu_own_bytes(self, name: str, pid: int, ram_mode: str, vma: dict[str, int] | None) -> int:
        """QEMU's memory minus guest RAM, refreshed every QEMU_OWN_REFRESH_S: reading a
        process's smaps walks all its mappings (~2 ms), too much to do for every sandbox at
        every sample in the process that also serves page faults."""
        from azqemu.bench import hostmem
        from azqemu.bench.linux_config import find_guest_ram

        now = time.monotonic()
        cached = self._qemu_own_cache.get(name)
        if cached is not None and cached[0] == pid and now - cached[1] < QEMU_OWN_REFRESH_S:
            return cached[2]
        if vma is None:
            start, end = find_guest_ram(pid, backing="ram.img" if ram_mode == "cow" else "memfd:")
            vma = hostmem.read_vma_smaps(pid, start, end)
        value = hostmem.qemu_own_bytes(hostmem.read_smaps_rollup(pid), vma)
        self._qemu_own_cache[name] = (pid, now, value)
        return value

    def op_owned(self, names: list[str] | None = None) -> dict[str, Any]:
        """Owned bytes of sandboxes (all by default), the store's total and the manager's RSS."""
        import psutil

        names = names if names is not None else [r.name for r in self.sandboxes.list()]
        # The store's arenas as tmpfs holds them (dead bytes not yet punched or compacted
        # included): host memory. Those dead bytes are nobody's, so every sandbox's store
        # bytes carry their share of them (pro rata): owned figures hide nothing.
        store_bytes, store_live, overhead = 0, 0, 1.0
        if self._store is not None:
            tb = self._store.total_bytes()
            store_bytes, store_live = int(tb.arena_allocated_bytes), int(tb.arena_live_bytes)
            dead = max(0, tb.arena_allocated_bytes - tb.arena_live_bytes)
            overhead = 1.0 + dead / tb.total_bytes if tb.total_bytes else 1.0
        rows = {}
        for n in names:
            try:
                rows[n] = self.owned(n, store_overhead=overhead)
            except AzqemuError as exc:
                rows[n] = {"name": n, "error": str(exc)}
        return {"sandboxes": rows, "store_bytes": store_bytes, "store_live_bytes": store_live,
                "manager_rss_bytes": psutil.Process().memory_info().rss}

    def op_list(self) -> list[dict[str, Any]]:
        return [self._describe(r) for r in self.sandboxes.list()]

    def op_dominfo(self, name: str) -> dict[str, Any]:
        rec = self._record(name)
        d = self._describe(rec)
        tmpl = self.templates.get(rec.template) if self.templates.exists(rec.template) else None
        if tmpl:
            d.update(mem_mib=tmpl.mem_mib, vcpus=tmpl.vcpus, machine=tmpl.machine, accel=tmpl.accel)
        return d

    def op_wait_agent(self, name: str, timeout_s: float = 30.0) -> float:
        dom = self._domain(name)
        try:
            return GuestAgent(name, dom.agent_command).wait_ready(float(timeout_s))
        except AgentTimeout:
            raise

    def close(self) -> None:
        """Stop serving faults without unregistering: QEMU keeps its uffd, so a compressed
        guest waits for the next manager instead of reading zero pages."""
        self.scheduler.stop()
        self.agent_links.stop()
        for mem in list(self.mem.values()):
            mem.handler.stop()
        if self._store is not None:
            self._store.flush()
        self.host.close()

    def op_memstats(self, name: str, reset: bool = False) -> dict[str, Any]:
        """Restore figures of one sandbox (azq bench restore): fault counters, per-fault
        service time over the faults since the last ``reset``, the last compress and resume."""
        self._record(name)
        mem = self.mem.get(name)
        if mem is None:
            raise ConfigError(f"{name!r}: the manager does not serve its memory "
                              "(an eager clone that was never compressed)")
        return mem.memstats(reset=bool(reset))
