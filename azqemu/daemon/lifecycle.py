"""The sandbox lifecycle service: clone batches, destroy, exec, pause, compress and resume.

A clone batch is all or nothing: names are checked before anything is made (a taken name
is refused and the existing sandbox is never touched), clones start in parallel, bounded,
and if one fails every sandbox the batch made is destroyed again. Compress pauses the
domain (marking it paused by azqemu) and has the memory service encode its RAM; resume
puts the hot set back first, then continues the vCPUs. Exec runs a command through the
guest agent, resuming a sandbox azqemu paused first; a sandbox its user paused is refused.
Every change to a sandbox holds that sandbox's lock (``Registry.lock``).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from azqemu.agent import GuestAgent
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.daemon.requests import MAX_CLONES_PER_REQUEST
from azqemu.errors import ConfigError, DomainStateError, SandboxExists
from azqemu.host import doctor
from azqemu.names import validate_name
from azqemu.sched import policy as policy_mod
from azqemu.sched.actions import SchedState
from azqemu.virt.clones import (
    DEFAULT_SHARING_DOMAIN,
    SandboxRecord,
    SandboxRepo,
    clone_one,
    cow_fill,
    destroy,
    eager_fill,
)
from azqemu.virt.host import Domain, Host
from azqemu.virt.identity import Identity
from azqemu.virt.templates import TemplateMeta

log = logging.getLogger(__name__)

# Clones start in parallel, bounded: each start costs libvirt and QEMU a few hundred ms of
# CPU. Measured here (2 cores, TCG, azq bench clone -n 16): 4 at once gave a median of
# 1.06 s per clone and 4.8 s in all, 2 at once 0.56 s and 4.6 s: more only queues.
MAX_PARALLEL_CLONES = 2
EXEC_DEFAULT_TIMEOUT_S = 300.0

# virt.clones.clone_one and virt.clones.destroy, or stand-ins in the unit tests.
CloneFn = Callable[..., SandboxRecord]
DestroyFn = Callable[[Host, SandboxRepo, str], None]


class Lifecycle:
    def __init__(self, registry: Registry, memory: MemoryService, *,
                 clone_fn: CloneFn = clone_one, destroy_fn: DestroyFn = destroy) -> None:
        self.reg = registry
        self.memory = memory
        self._clone_one = clone_fn
        self._destroy = destroy_fn

    # -- clone and destroy --------------------------------------------------------------
    def clone_batch(self, template: str, count: int = 1, name_prefix: str | None = None,
                    sharing_domain: str = DEFAULT_SHARING_DOMAIN, names: list[str] | None = None,
                    ram_mode: str | None = None, policy: str = "manual",
                    grace_s: float = policy_mod.DEFAULT_GRACE_S) -> list[dict[str, Any]]:
        """Clone ``template`` ``count`` times (or once per name of ``names``); all or nothing."""
        reg = self.reg
        pol = policy_mod.get(policy)
        tmpl = reg.templates.get(template)
        count = int(count)
        if names:
            count = len(names)
        if not 1 <= count <= MAX_CLONES_PER_REQUEST:
            raise ConfigError(f"clone count {count} out of range (1-{MAX_CLONES_PER_REQUEST})")
        validate_name(sharing_domain, "sharing domain")
        if not names:
            names = self._free_names(name_prefix or f"{template}-", count)
        for n in names:
            validate_name(n, "sandbox name")
        mode = self._ram_mode(ram_mode, pol.clone_mode)
        env = self._preload_env(mode) if self.memory.lazy_available else {}
        fills = {"eager": eager_fill, "cow": cow_fill}

        for n in names:
            # Refuse a taken name before anything is made (and never touch the existing one).
            if n in reg.sched or reg.sandboxes.path(n).exists() or reg.host.has_domain(n):
                raise SandboxExists(n)
        attached: set[str] = set()

        def lazy_fill(_dom: Domain, _pid: int, ident: Identity, t: TemplateMeta) -> None:
            self.memory.attach(ident.name, sharing_domain, t, lazy_clone=True, use_siblings=pol.use_siblings)
            attached.add(ident.name)

        def one(n: str) -> SandboxRecord:
            with reg.lock(n):
                try:
                    rec = self._clone_one(reg.host, tmpl, n, sharing_domain=sharing_domain, ram_mode=mode,
                                          fill=fills.get(mode, lazy_fill), repo=reg.sandboxes, env=env,
                                          ram_backing="file-private" if mode == "cow" else "memfd",
                                          policy=pol.name, grace_s=float(grace_s),
                                          ksm_merge=pol.linux_reclaim)
                    reg.sched[n] = SchedState(pol, grace_s=float(grace_s))
                    return rec
                except BaseException:
                    if n in attached:  # only the memory this attempt attached
                        self.memory.detach(n)
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
            # All or nothing: a partly made batch is removed so no orphan remains (its
            # domains, records, memory and scheduling state).
            for r in results:
                with contextlib.suppress(Exception):
                    self.destroy(r["name"])
            raise first_error
        return results

    def _free_names(self, prefix: str, count: int) -> list[str]:
        """The first ``count`` names ``<prefix><i>`` that no record nor domain uses."""
        taken = {r.name for r in self.reg.sandboxes.list()}
        names: list[str] = []
        i = 0
        while len(names) < count:
            cand = f"{prefix}{i}"
            if cand not in taken and not self.reg.host.has_domain(cand):
                names.append(cand)
            i += 1
        return names

    def _ram_mode(self, asked: str | None, policy_mode: str) -> str:
        mode = asked or policy_mode
        if mode == "lazy" and not self.memory.lazy_available and not asked:
            mode = "eager"  # the policy's choice where lazy clones are impossible (doctor says why)
        if mode not in ("eager", "lazy", "cow"):
            raise ConfigError(f"unknown RAM mode {mode!r} (eager, lazy, cow)")
        if mode == "lazy" and not self.memory.lazy_available:
            raise ConfigError(f"lazy clones are not available here: {doctor.restore_mode()[1]}")
        return mode

    def _preload_env(self, mode: str) -> dict[str, str]:
        """The export library in QEMU (qemu:env); it waits silently until the manager asks.
        Copy-on-write clones map the template's ram.img privately (virt/cowhook.py)."""
        return {"LD_PRELOAD": str(self.reg.cfg.preload_library),
                "AZQ_UFFD_SOCKET": "",  # per clone, filled in by clone_one
                "AZQ_UFFD_RAM_MATCH": "/ram.img" if mode == "cow" else "memory-backend-memfd"}

    def destroy(self, name: str) -> None:
        with self.reg.lock(name):
            # Unregister before the domain goes: a QEMU blocked on an unserved fault makes
            # libvirt's destroy hang for seconds.
            self.memory.cancel(name)
            self.reg.forget(name)
            self.memory.release(name)
            self._destroy(self.reg.host, self.reg.sandboxes, name)

    # -- exec ----------------------------------------------------------------------------
    def exec(self, name: str, argv: list[str], timeout_s: float = EXEC_DEFAULT_TIMEOUT_S,
             stdin_b64: str | None = None) -> dict[str, Any]:
        if not argv:
            raise ConfigError("no command given (azq exec SANDBOX -- CMD ...)")
        t0 = time.monotonic()
        dom = self.reg.domain(name)
        st = self.reg.sched.get(name)
        if st is not None:
            st.tracker.exec_started()  # from now on the scheduler leaves this sandbox alone
        try:
            self.memory.cancel(name)  # a compression in progress stops at its next step
            resume: dict[str, Any] = {}
            # Under the lock: a compression that already passed its last phase check may be
            # pausing the sandbox right now; once it is done (or cancelled) we see its mark.
            with self.reg.lock(name):
                if name in self.reg.paused_by_azq:
                    resume = self.resume_locked(name, dom, prefetch=st.policy.prefetch if st else True)
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

    # -- pause, compress, resume ---------------------------------------------------------
    def pause(self, name: str) -> None:
        """The user's pause: azqemu does not resume it (exec refuses it until resumed)."""
        with self.reg.lock(name):
            dom = self.reg.domain(name)
            if dom.state() != "paused":
                dom.suspend()

    def resume(self, name: str, prefetch: bool = True) -> dict[str, Any]:
        """Continue a sandbox; a compressed one gets its hot set back first."""
        self.memory.cancel(name)  # a compression in progress stops at its next step
        with self.reg.lock(name):
            return self.resume_locked(name, self.reg.domain(name), prefetch=prefetch)

    def resume_locked(self, name: str, dom: Domain, *, prefetch: bool = True) -> dict[str, Any]:
        """The caller holds the sandbox's lock."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {"prefetched_pages": 0, "prefetch_s": 0.0}
        out.update(self.memory.prefetch(name, hot=prefetch))
        if dom.state() == "paused":
            dom.resume()
        self.reg.paused_by_azq.discard(name)
        out["resume_s"] = time.perf_counter() - t0
        return out

    def trim(self, name: str) -> dict[str, Any] | None:
        """Drop the copies a running sandbox holds that still equal their stored entries
        (SandboxMemory.trim), its vCPUs paused for the scan; None when there is nothing to
        trim (never compressed, compressed now, or not running)."""
        with self.reg.lock(name):
            mem = self.memory.get(name)
            if mem is None or name in self.reg.paused_by_azq or not self.memory.has_stored(name):
                return None
            dom = self.reg.domain(name)
            if dom.state() != "running":
                return None
            dom.suspend()
            try:
                st = mem.trim()
            finally:
                dom.resume()
            log.debug("%s: trimmed %d of %d copies in %.1f ms (paused)", name, st.dropped_pages,
                      st.resident_pages, st.total_s * 1e3)
            return asdict(st)

    def compress(self, name: str) -> dict[str, Any]:
        """Pause the sandbox, encode its resident RAM into the store, punch it; stays paused."""
        with self.reg.lock(name):
            return self.compress_locked(name)

    def compress_locked(self, name: str) -> dict[str, Any]:
        """The caller holds the sandbox's lock."""
        rec = self.reg.record(name)
        dom = self.reg.domain(name)
        if not self.memory.lazy_available:
            raise ConfigError(f"cannot compress {name!r}: {doctor.restore_mode()[1]}")
        if dom.state() == "running":
            self.reg.paused_by_azq.add(name)
            dom.suspend()
        return self.memory.compress(rec)
