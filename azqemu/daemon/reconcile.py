"""Reconcile at start: make the daemon's records agree with libvirt's domains.

libvirt is the truth about which sandboxes run. A manager that starts (again) drops the
records of domains that vanished, gives running sandboxes without a record one back from
their domain metadata ("adopted", policy ``manual``), removes half-made templates and the
build domains of a manager that died, and takes the memory of lazy clones and of sandboxes
with pages in the store back, so a restarted daemon lists and serves the same sandboxes.
Store entries of sandboxes whose domain is gone, or whose domain UUID is not the one the
entries are bound to, are freed first: a name reused later starts empty. A sandbox whose
stored pages were lost (a quarantined store) is reported ``failed`` and its memory is not
served (its guest waits rather than read a wrong page). Every running sandbox gets its
lifecycle state back (``settled_state``): the one its record names, or where a manager died
in the middle of an operation, the state that operation leaves the sandbox in.
Domains of another manager (another state directory on the same libvirtd) are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import time

from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.daemon.states import PAUSED_BY_AZQ, State, parse_state
from azqemu.errors import AzqemuError
from azqemu.sched import policy as policy_mod
from azqemu.sched.actions import SchedState
from azqemu.virt.clones import DEFAULT_SHARING_DOMAIN, SandboxRecord
from azqemu.virt.host import Domain
from azqemu.virt.identity import remove_vm_dir

log = logging.getLogger(__name__)


def settled_state(rec: SandboxRecord, domain_state: str, lost: str | None, *,
                  stored: bool, adopted: bool = False) -> tuple[State, str | None, bool]:
    """The lifecycle state a restarted manager gives a running sandbox: (state, failed
    reason, paused by its user). A manager that died in the middle of an operation left its
    state in the record: a compression or resume that stopped with the vCPUs paused is
    ``compressed`` (a tool call resumes it, its pages come from the store), a destroy that
    did not finish is ``failed`` (destroy it again)."""
    persisted = parse_state(rec.state)
    paused = domain_state == "paused"
    if lost is not None:
        return State.FAILED, lost, False
    if persisted is State.FAILED:
        return State.FAILED, rec.failed_reason or "failed before the manager restarted", False
    if persisted is State.DESTROYING:
        return State.FAILED, "a destroy was interrupted (the manager stopped): destroy it again", False
    if paused and (persisted in PAUSED_BY_AZQ or (adopted and stored)):
        return State.COMPRESSED, None, False
    # A running sandbox found paused: its user's pause, unless the record says it was not (a
    # trim pauses the vCPUs without a state of its own); records from before: its user's.
    return State.RUNNING, None, paused and rec.user_paused is not False


def reconcile(reg: Registry, memory: MemoryService) -> dict[str, list[str]]:
    """Make records agree with libvirt; returns what changed (kept, dropped, adopted, removed)."""
    report: dict[str, list[str]] = {"kept": [], "dropped": [], "adopted": [], "removed": [], "freed": [],
                                    "failed": [], "continued": []}
    reg.templates.remove_stale_builds()
    state_dir = str(reg.cfg.state_dir)
    running: dict[str, tuple[Domain, dict[str, str]]] = {}
    for dom in reg.host.domains():
        meta = dom.metadata()
        if meta.get("state-dir", state_dir) != state_dir:
            continue  # another manager's sandbox (another state directory)
        if meta.get("role") == "template-build":
            # A template build whose manager died: its work dir is gone, so is its use.
            with contextlib.suppress(Exception):
                dom.destroy()
            remove_vm_dir(dom.name)
            report["removed"].append(dom.name)
        elif meta.get("role") == "sandbox":
            running[dom.name] = (dom, meta)
    for rec in reg.sandboxes.list():
        if rec.name in running:
            report["kept"].append(rec.name)
        else:
            reg.sandboxes.remove(rec.name)
            remove_vm_dir(rec.name)
            report["dropped"].append(rec.name)
    try:
        report["freed"] = memory.free_stale({name: dom.uuid for name, (dom, _meta) in running.items()})
    except AzqemuError as exc:
        log.error("cannot free stale store entries: %s", exc)
    for name, (dom, meta) in running.items():
        if name not in memory.failed and (meta.get("ram-mode") == "lazy" or memory.has_stored(name)):
            try:
                memory.attach(name, meta.get("sharing-domain", DEFAULT_SHARING_DOMAIN),
                              reg.templates.get(meta.get("template", "")),
                              lazy_clone=meta.get("ram-mode") == "lazy", owner=dom.uuid)
            except AzqemuError as exc:
                log.error("cannot reattach the memory of %s: %s", name, exc)
                memory.failed[name] = f"its memory cannot be served again after a restart: {exc}"
        adopted = not reg.sandboxes.path(name).exists()
        if not adopted:
            rec = reg.sandboxes.get(name)
            reg.sched[name] = SchedState(policy_mod.get(rec.policy), grace_s=rec.grace_s)
        else:
            rec = SandboxRecord(
                name=name, template=meta.get("template", "?"),
                sharing_domain=meta.get("sharing-domain", DEFAULT_SHARING_DOMAIN),
                ram_mode=meta.get("ram-mode", "eager"), uuid=dom.uuid, created_at=time.time())
            reg.sched[name] = SchedState(policy_mod.get("manual"))
            reg.sandboxes.save(rec)
            report["adopted"].append(name)
        dom_state = dom.state()
        state, reason, user_paused = settled_state(rec, dom_state, memory.failed.get(name),
                                                   stored=memory.has_stored(name), adopted=adopted)
        reg.settle(name, state, reason, user_paused=user_paused)
        if state is State.RUNNING and not user_paused and dom_state == "paused":
            # Paused by the manager that stopped (a trim's drop): it runs again, its memory
            # served (attached above), as it did before.
            try:
                dom.resume()
                report["continued"].append(name)
            except AzqemuError as exc:
                log.error("cannot continue %s, paused by the manager that stopped: %s", name, exc)
        if state is State.FAILED:
            report["failed"].append(name)
            log.error("sandbox %s is failed: %s", name, reason)
    log.info("reconciled with libvirt: %s", report)
    return report
