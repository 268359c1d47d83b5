"""The sandbox lifecycle service: clone batches, destroy, exec, pause, compress and resume.

Every operation goes through the sandbox's state machine (azqemu/daemon/states.py): it holds
the sandbox's ``Slot.lock``, checks the state it needs and moves the sandbox with
``Slot.to``, so compress, resume, exec and destroy on one sandbox, in any order and from any
number of threads, each end in one defined way:

- destroy marks the sandbox, cancels a compression in progress (it stops at its next step),
  then waits for the lock; operations that had not started yet refuse (SandboxStateError),
  operations that wait for the lock afterwards find the sandbox gone (SandboxNotFound);
- compress needs ``running`` (or ``compressed``: again) and no command running in the guest;
  it ends ``compressed``, or ``running`` again (vCPUs continued) when cancelled or refused
  before anything was lost (StoreFull, a cancel); a crash in it fails the sandbox;
- resume and exec cancel a compression, wait for it, and resume a ``compressed`` sandbox:
  ``resuming`` puts the hot set back, continues the vCPUs and ends ``running``; a page that
  cannot be produced fails the sandbox with the reason (never a guest waiting in silence).
  An exec continues the vCPUs first and puts the hot set back beside its call (UFFDIO_COPY
  skips a page the guest faulted in meanwhile), joined before the call returns;
- a ``failed`` sandbox refuses everything but destroy, and says why.

A clone batch is all or nothing: names are checked before anything is made (a taken name
is refused and the existing sandbox is never touched), clones start in parallel, bounded,
and if one fails every sandbox the batch made is destroyed again. Exec runs a command
through the guest agent; a sandbox its user paused is refused. A sandbox made and one
destroyed by azqemu are published as events (``created``, ``destroyed``: the daemon's event
log, daemon/eventlog.py).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from azqemu.agent import GuestAgent, OutputSink
from azqemu.daemon.eventlog import Publish, discard
from azqemu.daemon.memsvc import MemoryService, unrestorable_reason
from azqemu.daemon.registry import Registry
from azqemu.daemon.requests import MAX_CLONES_PER_REQUEST
from azqemu.daemon.states import TRANSIENT, Slot, State
from azqemu.errors import (
    AzqemuError,
    ConfigError,
    DomainStateError,
    RestoreError,
    SandboxExists,
    SandboxNotFound,
    SandboxStateError,
    StoreError,
)
from azqemu.host import doctor, schedstat, threads
from azqemu.memory.crashpoint import crash_point
from azqemu.names import validate_name
from azqemu.restore.errors import PageUnavailable
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
                 clone_fn: CloneFn = clone_one, destroy_fn: DestroyFn = destroy,
                 publish: Publish = discard) -> None:
        self.reg = registry
        self.memory = memory
        self.publish = publish
        self._clone_one = clone_fn
        self._destroy = destroy_fn
        # The memory service fails sandboxes it cannot serve (lost pages, a handler that
        # keeps dying) through this narrow callback.
        memory.on_failed = registry.fail
        # Told each time azqemu starts or continues a sandbox's vCPUs after they stood still
        # (a clone, a resume, a compression that ended early): the manager sends the guest the
        # host's wall clock then (daemon/guestclock.py). Never raises.
        self.on_vcpus_continued: Callable[[str], object] = lambda _name: None

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
            slot = reg.slots.get(n)
            if (n in reg.sched or reg.sandboxes.path(n).exists() or reg.host.has_domain(n)
                    or (slot is not None and not slot.retired)):
                raise SandboxExists(n)
        attached: set[str] = set()

        def lazy_fill(_dom: Domain, _pid: int, ident: Identity, t: TemplateMeta) -> None:
            self.memory.attach(ident.name, sharing_domain, t, lazy_clone=True, use_siblings=pol.use_siblings)
            attached.add(ident.name)

        def one(n: str) -> SandboxRecord:
            try:
                slot = reg.slots.add(n, State.CREATING)
            except SandboxStateError:
                raise SandboxExists(n) from None    # another batch makes it right now
            with slot.lock:
                t0 = time.perf_counter()
                try:
                    rec = self._clone_one(reg.host, tmpl, n, sharing_domain=sharing_domain, ram_mode=mode,
                                          fill=fills.get(mode, lazy_fill), repo=reg.sandboxes, env=env,
                                          ram_backing="file-private" if mode == "cow" else "memfd",
                                          policy=pol.name, grace_s=float(grace_s),
                                          ksm_merge=pol.linux_reclaim)
                    reg.sched[n] = SchedState(pol, grace_s=float(grace_s))
                    slot.to(State.RUNNING)
                    rec.state = State.RUNNING.value
                    self.on_vcpus_continued(n)      # its clock is the template's, saved long ago
                    self.publish(n, "created", f"{mode} clone of {template}", template=template, ram_mode=mode,
                                 policy=pol.name, duration_s=round(time.perf_counter() - t0, 6))
                    return rec
                except BaseException:
                    if n in attached:  # only the memory this attempt attached
                        self.memory.detach(n)
                    reg.slots.remove(n, slot)
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

    # -- the state machine's door ---------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, name: str, operation: str) -> Iterator[Slot]:
        """Hold the sandbox's lock for ``operation``: SandboxNotFound if it went while we
        waited, SandboxStateError if a destroy asked for it first."""
        slot = self.reg.slot(name)
        with slot.lock:
            if slot.retired:
                raise SandboxNotFound(name)
            if slot.destroy_requested:
                raise SandboxStateError(name, State.DESTROYING.value, operation)
            yield slot

    @staticmethod
    def _end(slot: Slot, new: State, operation: str) -> None:
        """The last step of an operation: a sandbox that failed meanwhile stays failed and
        the operation reports why."""
        if slot.state is State.FAILED:
            raise SandboxStateError(slot.name, State.FAILED.value, operation, slot.reason)
        slot.to(new)

    # -- destroy -------------------------------------------------------------------------
    def destroy(self, name: str) -> None:
        """Cancel what runs on the sandbox, wait for it, then destroy it (from any state)."""
        slot = self.reg.find_slot(name)
        if slot is None:
            self._destroy(self.reg.host, self.reg.sandboxes, name)  # a domain without a record
            return
        slot.request_destroy()
        try:
            rec: SandboxRecord | None = self.reg.sandboxes.get(name)
        except AzqemuError:
            rec = None
        # A compression in progress stops at its next step, so the wait below is short; one
        # that starts after this (it passed the destroy_requested check just before) stops
        # at its first step: this cancel is for good, a compression does not clear it (an
        # eager clone's first compression, whose memory is attached only then, runs on).
        self.memory.cancel(name, for_good=True)
        with slot.lock:
            if slot.retired:
                raise SandboxNotFound(name)
            if slot.state in TRANSIENT - {State.CREATING}:
                # Left there by an operation that ended without settling (a bug): failed,
                # so that the destroy below is a transition the table allows.
                slot.fail(f"found {slot.state.value} with no operation under way")
            was = slot.state
            slot.to(State.DESTROYING)
            t0 = time.perf_counter()
            self.reg.sched.pop(name, None)
            try:
                # Unregister before the domain goes: a QEMU blocked on an unserved fault
                # makes libvirt's destroy hang for seconds.
                self.memory.cancel(name)
                self.memory.release(name)
                self._destroy(self.reg.host, self.reg.sandboxes, name)
            except BaseException as exc:
                slot.to(State.FAILED, f"destroy failed: {type(exc).__name__}: {exc}")
                raise
            self.memory.domain_gone(name)
            self.reg.forget(name)
            self.publish(name, "destroyed", f"by azqemu (was {was.value})", state=was.value,
                         duration_s=round(time.perf_counter() - t0, 6))
        self._give_back_template_zeros(rec)

    def _give_back_template_zeros(self, rec: SandboxRecord | None) -> None:
        """Once a template's last copy-on-write clone is gone, the zero pages its clones made
        its tmpfs working copy hold go back to the host (TemplateRepo.give_back_zero_pages):
        without that the template keeps growing by every hole a clone ever touched."""
        if rec is None or rec.ram_mode != "cow" or self.reg.clones_of(rec.template):
            return
        try:
            freed = self.reg.templates.give_back_zero_pages(rec.template)
        except (OSError, AzqemuError) as exc:
            log.warning("template %s: zero pages not given back: %s", rec.template, exc)
            return
        if freed:
            log.info("template %s: %d MiB of zero pages its clones allocated given back", rec.template, freed >> 20)

    # -- exec ----------------------------------------------------------------------------
    def exec(self, name: str, argv: list[str], timeout_s: float = EXEC_DEFAULT_TIMEOUT_S,
             stdin_b64: str | None = None, on_output: OutputSink | None = None,
             kind: str | None = None) -> dict[str, Any]:
        if not argv:
            raise ConfigError("no command given (azq exec SANDBOX -- CMD ...)")
        t0 = time.monotonic()
        slot = self.reg.slot(name)
        dom = self.reg.domain(name)
        st = self.reg.sched.get(name)
        if st is not None:
            st.tracker.exec_started()  # from now on the scheduler leaves this sandbox alone
        slot.exec_started()            # and a compress asked for now is refused
        stdin = base64.b64decode(stdin_b64) if stdin_b64 else None
        call = self.memory.note_call(name, argv, stdin, kind)   # what a resume brings back
        try:
            self.memory.cancel(name)  # a compression in progress stops at its next step
            resume: dict[str, Any] = {}
            beside: Future[dict[str, Any]] | None = None     # the hot set coming back beside the call
            # Under the lock: a compression that already passed its last phase check may be
            # pausing the sandbox right now; once it is done (or cancelled) we see its state.
            with self._locked(name, "exec") as slot:
                lock_wait_s = time.monotonic() - t0
                state = slot.require("exec", (State.RUNNING, State.COMPRESSED))
                prefetch = st.policy.prefetch if st else True
                if state is State.COMPRESSED and not slot.user_paused:
                    resume = self.resume_locked(name, dom, prefetch=prefetch, call=call,
                                                beside=prefetch and st is not None and st.policy.prefetch_beside)
                    beside = resume.pop("beside", None)
                elif prefetch and not slot.user_paused:
                    resume = self.memory.refill(name, call)
            dstate = dom.state()
            if dstate != "running":
                raise DomainStateError(name, dstate, "running")
            agent = GuestAgent(name, dom.agent_command)
            mem = self.memory.get(name)
            before = mem.call_counters() if mem is not None else (0, 0, 0.0)
            # The vCPUs' waits for a CPU: what a fault costs on this host now (callkinds.py).
            qemu_pid = mem.handle.pid if mem is not None else None
            vcpu_before = schedstat.vcpu_wait(qemu_pid) if qemu_pid else None
            t_run = time.monotonic()
            res = agent.exec(argv, timeout_s=float(timeout_s), stdin=stdin, on_output=on_output,  # streamed if given
                             exit_wait=lambda pid, t: self.reg.exits.wait_exit(name, pid, t))
            vcpu_after = schedstat.vcpu_wait(qemu_pid) if qemu_pid else None
            self.memory.note_call_end(name, call, time.monotonic() - t_run,
                                      schedstat.wait_per_slice_s(vcpu_before, vcpu_after))
            after = mem.call_counters() if mem is not None else before
            faults, store_faults, trim_s = (after[0] - before[0], after[1] - before[1], after[2] - before[2])
        finally:
            try:
                if beside is not None:  # done long before a call ends, but never outlives it
                    resume.update(beside.result())      # a page it could not produce: raised here
            finally:
                slot.exec_ended()
                if st is not None:
                    st.tracker.exec_ended()
        # Where the call's time went, beside the guest's own run: waiting for an operation on
        # the sandbox to stop (lock_wait_s), the resume, the trims' pauses and the faults
        # served while the command ran (the density benchmark's breakdown per tool call).
        return {"exit_code": res.exit_code, "stdout_b64": base64.b64encode(res.stdout).decode(),
                "stderr_b64": base64.b64encode(res.stderr).decode(), "duration_s": time.monotonic() - t0,
                "resume_s": resume.get("resume_s", 0.0), "prefetched_pages": resume.get("prefetched_pages", 0),
                "lock_wait_s": lock_wait_s, "faults": faults, "faults_from_store": store_faults,
                "trim_paused_s": trim_s}

    # -- pause, compress, resume ---------------------------------------------------------
    def pause(self, name: str) -> None:
        """The user's pause: azqemu does not resume it (exec refuses it until resumed)."""
        with self._locked(name, "pause") as slot:
            slot.require("pause", (State.RUNNING, State.COMPRESSED))
            dom = self.reg.domain(name)
            if dom.state() != "paused":
                dom.suspend()
            slot.user_paused = True
            self.reg.update_record(name, user_paused=True)    # so that a restarted manager knows

    def resume(self, name: str, prefetch: bool = True) -> dict[str, Any]:
        """Continue a sandbox; a compressed one gets its hot set back first."""
        self.reg.slot(name)
        self.memory.cancel(name)  # a compression in progress stops at its next step
        with self._locked(name, "resume") as slot:
            slot.require("resume", (State.RUNNING, State.COMPRESSED))
            if slot.user_paused:
                self.reg.update_record(name, user_paused=False)
            slot.user_paused = False
            return self.resume_locked(name, self.reg.domain(name), prefetch=prefetch)

    def resume_locked(self, name: str, dom: Domain, *, prefetch: bool = True, call: int | None = None,
                      beside: bool = False) -> dict[str, Any]:
        """The caller holds the sandbox's lock. A running sandbox's vCPUs are continued (the
        user's pause); a compressed one goes through ``resuming`` (``call``: the kind of tool
        call that resumes it, MemoryService.note_call). ``beside`` (a tool call's resume): the
        vCPUs continue first and the hot set comes back beside the call, a Future under
        "beside" (MemoryService.prefetch_beside), so that the call does not wait for it."""
        t0 = time.perf_counter()
        out: dict[str, Any] = {"prefetched_pages": 0, "prefetch_s": 0.0}
        slot = self.reg.slot(name)
        state = slot.require("resume", (State.RUNNING, State.COMPRESSED))
        if state is State.RUNNING:
            if dom.state() == "paused":
                dom.resume()
                self.on_vcpus_continued(name)
            out["resume_s"] = time.perf_counter() - t0
            return out
        slot.to(State.RESUMING)
        crash_point("before-prefetch")
        try:
            # Beside a call, the pages its guest touched first last time still go before the
            # vCPUs continue (callkinds: the early set); the rest beside the call.
            out.update(self.memory.prefetch(name, hot=prefetch, call=call, part="early" if beside else "all"))
            if not beside:
                crash_point("after-prefetch")
            if dom.state() == "paused":
                dom.resume()
                self.on_vcpus_continued(name)
            crash_point("after-vcpu-resume")
        except (StoreError, RestoreError) as exc:
            if isinstance(exc, (StoreError, PageUnavailable)):
                # A page the guest needs cannot be produced: it would wait on it for ever.
                slot.fail(unrestorable_reason(exc))
            else:
                with contextlib.suppress(SandboxStateError):
                    slot.to(State.COMPRESSED)
            raise
        except AzqemuError:
            with contextlib.suppress(SandboxStateError):   # libvirt refused: still paused
                slot.to(State.COMPRESSED)
            raise
        except BaseException as exc:
            slot.fail(f"resume crashed: {type(exc).__name__}: {exc}")
            raise
        self._end(slot, State.RUNNING, "resume")
        if beside:
            out["beside"] = self.memory.prefetch_beside(name, hot=prefetch, call=call, part="rest")
        out["resume_s"] = time.perf_counter() - t0
        return out

    def trim(self, name: str) -> dict[str, Any] | None:
        """Drop the copies a running sandbox holds that still equal their stored entries, or
        that it left alone long enough to encode (SandboxMemory.trim): scanned and encoded
        beside the guest, its vCPUs paused only to check and drop; None when there is nothing
        to trim (never compressed, compressed now, or not running)."""
        with self._locked(name, "trim") as slot:
            ticket = self.memory.cancel_ticket(name)    # before the checks (MemoryService.cancel_ticket)
            mem = self.memory.get(name)
            if (mem is None or slot.state is not State.RUNNING or slot.user_paused
                    or not self.memory.has_stored(name)):
                return None
            dom = self.reg.domain(name)
            if dom.state() != "running":
                return None

            @contextlib.contextmanager
            def paused() -> Iterator[None]:
                dom.suspend()
                try:
                    # The guest waits in its tool call until this returns: run above the guests.
                    with threads.at_nice(threads.PAUSED_GUEST_NICE):
                        yield
                finally:
                    dom.resume()
            st = mem.trim(stop=self.memory.stop_test(name, ticket), paused=paused)
            log.debug("%s: trimmed %d of %d copies (%d zero, %d encoded, %d written meanwhile, cold after %.0f s,"
                      " %.0f%% came back) in %.1f ms, %.1f ms paused (check %.1f, drop %.1f, map %.1f)", name,
                      st.dropped_pages, st.resident_pages, st.zero_pages, st.encoded_pages, st.changed_pages,
                      st.cold_after_s, 100 * mem.cold.last_refault, st.total_s * 1e3, st.paused_s * 1e3,
                      st.verify_s * 1e3, st.drop_s * 1e3, st.map_s * 1e3)
            return asdict(st)

    def compress(self, name: str) -> dict[str, Any]:
        """Pause the sandbox, encode its resident RAM into the store, punch it; stays paused."""
        with self._locked(name, "compress"):
            return self.compress_locked(name)

    def compress_locked(self, name: str, ticket: int | None = None) -> dict[str, Any]:
        """The caller holds the sandbox's lock. ``ticket``: the cancel ticket taken when the
        compression was decided (MemoryService.cancel_ticket); taken here if None."""
        if ticket is None:
            ticket = self.memory.cancel_ticket(name)
        slot = self.reg.slot(name)
        rec = self.reg.record(name)
        dom = self.reg.domain(name)
        if not self.memory.lazy_available:
            raise ConfigError(f"cannot compress {name!r}: {doctor.restore_mode()[1]}")
        before = slot.require("compress", (State.RUNNING, State.COMPRESSED))
        if slot.destroy_requested:
            raise SandboxStateError(name, State.DESTROYING.value, "compress")
        if slot.execs:
            # Its vCPUs would stop under the command, which would then wait for its timeout.
            raise SandboxStateError(name, before.value, "compress", "a command runs in it (exec)")
        slot.to(State.COMPRESSING)
        paused_here = False
        try:
            if dom.state() == "running":
                dom.suspend()
                paused_here = True
            crash_point("after-pause")
            out = self.memory.compress(rec, ticket)
        except (AzqemuError, OSError) as exc:
            # Refused or cancelled before anything was lost: the guest keeps its pages (or the
            # store, committed before any drop, serves them); it runs on as it was.
            log.info("%s: compression ended early: %s", name, exc)
            self._back_from_compress(slot, before, dom, paused_here)
            raise
        except BaseException as exc:
            slot.fail(f"compression crashed: {type(exc).__name__}: {exc}")
            raise
        if out.get("cancelled"):
            self._back_from_compress(slot, before, dom, paused_here)
        else:
            self._end(slot, State.COMPRESSED, "compress")
        return out

    def _back_from_compress(self, slot: Slot, before: State, dom: Domain, paused_here: bool) -> None:
        """A compression that did not finish: back to ``before``, vCPUs continued if it
        paused them (whoever cancelled it wants them running, or destroys the sandbox)."""
        if slot.state is State.FAILED:
            return
        if before is State.RUNNING and paused_here:
            try:
                dom.resume()
            except AzqemuError as exc:
                slot.fail(f"vCPUs could not be continued after a compression ended early: {exc}")
                return
            self.on_vcpus_continued(slot.name)
        slot.to(before)

