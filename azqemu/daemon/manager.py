"""The manager: every operation the CLI can ask for, as a thin facade over the daemon's services.

Each public method ``op_<name>`` is one protocol operation (the server dispatches by name;
arguments arrive as JSON values) and delegates to the service that owns its concern:

    registry.Registry        records, per-sandbox locks, scheduling state, paused-by-azqemu marks
    reconcile.reconcile      records against libvirt's domains, once at start
    lifecycle.Lifecycle      clone batches (all or nothing), destroy, exec, pause, compress, resume
    memsvc.MemoryService     the page store, template images, each sandbox's SandboxMemory
    accounting.Accounting    resident, stored and owned bytes, QEMU's own memory
    schedsvc.SchedService    what the scheduler may do (sched.actions.SchedActions), phase hints,
                             policies, the in-guest agent's reports
    eventlog.EventLog        the events of sandboxes, libvirt's and azqemu's own (``azq events``);
                             each service gets only its ``publish``
    guestclock.GuestClock    the host's wall clock to a guest whose vCPUs azqemu continued

The scheduler (``sched.scheduler``) sees only ``SchedService``, through ``SchedActions``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from azqemu import config as config_mod
from azqemu.agent import OutputSink
from azqemu.daemon.accounting import Accounting
from azqemu.daemon.domainmeta import MetadataWriter
from azqemu.daemon.eventlog import EventLog
from azqemu.daemon.guestclock import GuestClock
from azqemu.daemon.lifecycle import EXEC_DEFAULT_TIMEOUT_S, Lifecycle
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.reconcile import reconcile
from azqemu.daemon.registry import Registry
from azqemu.daemon.schedsvc import SchedService
from azqemu.daemon.states import State
from azqemu.daemon.watch import DomainWatcher
from azqemu.errors import SandboxNotFound
from azqemu.host import doctor
from azqemu.memory import zstdlib
from azqemu.sched import policy as policy_mod
from azqemu.sched.agentlink import AgentLinks
from azqemu.sched.scheduler import Scheduler
from azqemu.virt.clones import DEFAULT_SHARING_DOMAIN, SandboxRepo
from azqemu.virt.host import Host
from azqemu.virt.templates import TemplateRepo, create_template, warmup_from_cli

log = logging.getLogger(__name__)


class Manager:
    def __init__(self, cfg: config_mod.Config | None = None, host: Host | None = None) -> None:
        self.cfg = cfg or config_mod.load()
        self.started_at = time.time()
        self.registry = Registry(self.cfg, host or Host(self.cfg.libvirt_uri),
                                 TemplateRepo(self.cfg), SandboxRepo(self.cfg))
        self._template_lock = threading.Lock()
        self.events = EventLog()
        self.registry.slots.on_failed = self._published_failure
        mode, why = doctor.restore_mode()
        log.info("restore mode: %s (%s)", mode, why)
        self.memory = MemoryService(self.cfg, self.registry.templates, self.registry.sandboxes,
                                    lazy_available=mode == "lazy")
        self.memory.publish = self.events.publish
        self.accounting = Accounting(self.registry, self.memory)
        self.lifecycle = Lifecycle(self.registry, self.memory, publish=self.events.publish)
        self.schedsvc = SchedService(self.registry, self.lifecycle, self.accounting, publish=self.events.publish)
        self.reconcile()
        # AZQ_COMPRESS_LOOPS_BELOW=1: only the compression worker's C loops at nice 19, the rest
        # above the guests (host/threads.py, background_worker: measured as a trade, off).
        loops_below = os.environ.get("AZQ_COMPRESS_LOOPS_BELOW", "0") == "1"
        self.scheduler = Scheduler(self.schedsvc, run_loops_below=zstdlib.run_loops_below if loops_below else None)
        self.agent_links = AgentLinks(self.schedsvc.agent_sockets, self.schedsvc.on_agent_message)
        self.guest_clock = GuestClock(self.agent_links.send)
        self.lifecycle.on_vcpus_continued = self.guest_clock.sync
        self.watcher = DomainWatcher(self.registry, self.memory,  # domains stopped outside azqemu
                                     eventlog=self.events)
        # State in each domain's <metadata> for virsh and Nova-style tools (daemon/domainmeta.py);
        # the API gives the labels (labels_of).
        self.labels_of: Callable[[str], dict[str, str]] | None = None
        self.metadata = MetadataWriter(self._metadata_of, self._write_metadata)
        self.registry.on_record_change = self.metadata.request

    def start(self) -> None:
        """Start the background work: the scheduler, the in-guest agent links, the lifecycle watcher."""
        self.scheduler.start()
        self.agent_links.start()
        self.watcher.start()
        self.metadata.start()
        for rec in self.registry.sandboxes.list():   # what reconcile settled, and older daemons' domains
            self.metadata.request(rec.name)

    def reconcile(self) -> dict[str, list[str]]:
        """Make records agree with libvirt; returns what changed."""
        return reconcile(self.registry, self.memory)

    def close(self) -> None:
        """Stop serving faults without unregistering: QEMU keeps its uffd, so a compressed
        guest waits for the next manager instead of reading zero pages."""
        self.watcher.stop()
        self.metadata.stop()
        self.scheduler.stop()
        self.agent_links.stop()
        self.memory.close()
        self.registry.host.close()

    def _published_failure(self, name: str, was: State, reason: str) -> None:
        self.events.publish(name, "failed", reason, reason=reason, state=was.value)

    def _metadata_of(self, name: str) -> tuple[dict[str, str], dict[str, str] | None] | None:
        """What ``<azq:sandbox>`` says of ``name`` now (None once it has no record)."""
        try:
            rec = self.registry.record(name)
        except SandboxNotFound:
            return None
        state, _reason = self.registry.state_of(name)
        st = self.registry.sched.get(name)
        mem = self.memory.get(name)
        stored = 0
        if mem is not None:
            last = self.memory.last_stored_bytes.get(name)   # None: not compressed since attached
            stored = mem.stored_bytes() if last is None else last
        attrs = {"state": state, "policy": rec.policy,
                 "compressed": "yes" if mem is not None and mem.compressed else "no",
                 "stored-bytes": str(stored)}
        if st is not None:
            attrs["phase"] = st.tracker.current().phase
        return attrs, (self.labels_of(name) if self.labels_of is not None else None)

    def _write_metadata(self, name: str, attrs: dict[str, str], labels: dict[str, str] | None) -> None:
        self.registry.host.get_domain(name).set_metadata(attrs, labels)

    # -- operations ----------------------------------------------------------------------
    def op_ping(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": os.getpid(), "started_at": self.started_at,
                               "sandboxes": len(self.registry.sandboxes.list())}
        try:
            # The manager's own memory and its parts (Accounting.manager_memory): a ping
            # that cannot read them still answers.
            out["manager_memory"] = mm = self.accounting.manager_memory_cached()
            out["manager_rss_bytes"] = mm["rss_bytes"]
        except Exception as exc:  # noqa: BLE001
            log.debug("manager memory: %s", exc)
        return out

    def op_template_create(self, name: str, mem_mib: int = 512, vcpus: int = 1,
                           warmup: list[str] | None = None) -> dict[str, Any]:
        with self._template_lock:
            meta = create_template(self.registry.host, self.registry.templates, name, mem_mib=int(mem_mib),
                                   vcpus=int(vcpus), warmup=warmup_from_cli(tuple(warmup or ())),
                                   progress=lambda m: log.info("template %s: %s", name, m))
        return asdict(meta)

    def op_template_list(self) -> list[dict[str, Any]]:
        out = []
        for t in self.registry.templates.list():
            d = asdict(t)
            d["clones"] = len(self.registry.clones_of(t.name))
            out.append(d)
        return out

    def op_template_delete(self, name: str) -> None:
        with self._template_lock:
            self.registry.templates.delete(name, self.registry.clones_of(name))
            self.memory.drop_template(name)   # its image's mapping would pin the deleted file

    def op_clone(self, template: str, count: int = 1, name_prefix: str | None = None,
                 sharing_domain: str = DEFAULT_SHARING_DOMAIN, names: list[str] | None = None,
                 ram_mode: str | None = None, policy: str = "manual",
                 grace_s: float = policy_mod.DEFAULT_GRACE_S) -> list[dict[str, Any]]:
        return self.lifecycle.clone_batch(template, count=count, name_prefix=name_prefix,
                                          sharing_domain=sharing_domain, names=names, ram_mode=ram_mode,
                                          policy=policy, grace_s=grace_s)

    def op_exec(self, name: str, argv: list[str], timeout_s: float = EXEC_DEFAULT_TIMEOUT_S,
                stdin_b64: str | None = None, on_output: OutputSink | None = None,
                kind: str | None = None) -> dict[str, Any]:
        return self.lifecycle.exec(name, argv, timeout_s=timeout_s, stdin_b64=stdin_b64, on_output=on_output,
                                   kind=kind)

    def op_phase(self, name: str, phase: str) -> dict[str, Any]:
        out = self.schedsvc.phase(name, phase)
        self.metadata.request(name)
        return out

    def op_set_policy(self, names: list[str], policy: str, grace_s: float | None = None,
                      pressure_budget_bytes: int | None = None) -> None:
        self.schedsvc.set_policy(names, policy, grace_s)
        if pressure_budget_bytes is not None:
            self.scheduler.pressure_budget_bytes = int(pressure_budget_bytes) or None

    def op_pause(self, name: str) -> None:
        self.lifecycle.pause(name)

    def op_resume(self, name: str, prefetch: bool = True) -> dict[str, Any]:
        return self.lifecycle.resume(name, prefetch=bool(prefetch))

    def op_compress(self, name: str) -> dict[str, Any]:
        return self.lifecycle.compress(name)

    def op_trim(self, name: str) -> dict[str, Any] | None:
        """Drop the copies a running sandbox holds that still equal their stored entries
        (what the scheduler does in long tool calls); None if there is nothing to trim."""
        self.registry.record(name)
        return self.lifecycle.trim(name)

    def op_destroy(self, name: str) -> None:
        self.lifecycle.destroy(name)

    def op_events(self, since: float = 0.0, sandbox: str | None = None,
                  event: list[str] | None = None) -> list[dict[str, Any]]:
        """Recent events of sandboxes, oldest first: libvirt's lifecycle events and azqemu's own
        (daemon/eventlog.py); only those of ``sandbox`` and of the kinds in ``event`` if given."""
        return self.events.events(float(since), sandbox=sandbox, kinds=event)

    def op_owned(self, names: list[str] | None = None) -> dict[str, Any]:
        return self.accounting.owned_all(names)

    def op_list(self) -> list[dict[str, Any]]:
        return [self.accounting.describe(r) for r in self.registry.sandboxes.list()]

    def op_dominfo(self, name: str) -> dict[str, Any]:
        """The accounting's view, and what the in-guest agent's channel counted (lines taken
        and refused, clock steps; None while the manager is not connected to it)."""
        return self.accounting.dominfo(name) | {"agent_channel": self.agent_links.stats(name)}

    def op_domstats(self, name: str) -> dict[str, Any]:
        return self.accounting.domstats(name)

    def op_memstats(self, name: str, reset: bool = False) -> dict[str, Any]:
        """Restore figures of one sandbox (azq bench restore): fault counters, per-fault
        service time over the faults since the last ``reset``, the last compress and resume."""
        self.registry.record(name)
        return self.memory.memstats(name, reset=bool(reset))
