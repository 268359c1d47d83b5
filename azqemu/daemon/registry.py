"""The daemon's books: what it knows of its sandboxes besides what libvirt says.

One ``Registry`` is shared by the daemon's services: the libvirt host, the template and
sandbox records on disk, each sandbox's lifecycle ``Slot`` (its state, failure reason and
the lock every operation that changes it holds; azqemu/daemon/states.py), its scheduling
state and the command ends its in-guest agent reported. A slot's state is written into the
sandbox's record at every change, so a restarted daemon knows which sandboxes were failed
(and why) or compressed. libvirt stays the truth about what runs (``reconcile`` makes the
books agree at start).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from azqemu import config as config_mod
from azqemu.daemon.states import PAUSED_BY_AZQ, Slot, SlotTable, State, parse_state
from azqemu.errors import DomainNotFound, SandboxNotFound
from azqemu.sched.actions import SchedState
from azqemu.sched.exitwatch import ExitWatch
from azqemu.virt.clones import SandboxRecord, SandboxRepo
from azqemu.virt.host import Domain, Host
from azqemu.virt.templates import TemplateRepo

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, cfg: config_mod.Config, host: Host, templates: TemplateRepo,
                 sandboxes: SandboxRepo) -> None:
        self.cfg = cfg
        self.host = host
        self.templates = templates
        self.sandboxes = sandboxes
        # Read-modify-write of records: a state change (from any thread) and a policy change
        # never write over each other.
        self._records_mu = threading.Lock()
        self.slots = SlotTable(on_change=self._persist_state)
        self.sched: dict[str, SchedState] = {}
        # The ends of guest-exec'd commands the in-guest agents reported (exec waits on them).
        self.exits = ExitWatch()
        # Told of every record change, to mirror it into the domain's <metadata> (the
        # manager's daemon/domainmeta.MetadataWriter; never blocks).
        self.on_record_change: Callable[[str], None] | None = None
        # Told of every sandbox that goes away (destroyed, or lost outside azqemu), after its
        # scheduling state: caches keyed by its name (the accounting's) drop it then, not at
        # their next full sweep, which a daemon that only serves metrics never makes.
        self.on_forget: list[Callable[[str], None]] = []

    # -- lifecycle state --------------------------------------------------------------------
    def slot(self, name: str) -> Slot:
        """The sandbox's slot; SandboxNotFound if there is neither a slot nor a record."""
        slot = self.slots.get(name)
        if slot is not None:
            return slot
        rec = self.record(name)
        return self.slots.get_or_add(name, lambda: (parse_state(rec.state), rec.failed_reason))

    def find_slot(self, name: str) -> Slot | None:
        try:
            return self.slot(name)
        except SandboxNotFound:
            return None

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """Hold the lock of ``name``'s operations: its current slot's. A slot retired while
        we waited for it (the sandbox went, and a clone may have taken the name again) guards
        nothing any more: the caller would act on the new sandbox under the old lock, beside
        whoever holds the new one. So the wait starts over on the name's current slot. A name
        with neither slot nor record holds nothing (the caller finds no record)."""
        while True:
            slot = self.find_slot(name)
            if slot is None:
                yield
                return
            with slot.lock:
                if not slot.retired:
                    yield
                    return

    def state_of(self, name: str) -> tuple[str, str | None]:
        """(state, failed reason) of a sandbox for ``azq list``/``dominfo``."""
        slot = self.find_slot(name)
        if slot is None:
            return "gone", None
        state, reason = slot.snapshot()
        return state.value, reason

    @property
    def paused_by_azq(self) -> frozenset[str]:
        """Sandboxes whose vCPUs azqemu stopped (compressing, compressed, resuming) and the
        user did not pause: a tool call resumes them; a sandbox its user paused stays paused."""
        return frozenset(n for n, s in self.slots.items() if s.state in PAUSED_BY_AZQ and not s.user_paused)

    def fail(self, name: str, reason: str) -> bool:
        """Fail a sandbox from any thread (without its lock); False if unknown or failed already."""
        slot = self.find_slot(name)
        if slot is None:
            return False
        if slot.fail(reason):
            log.error("sandbox %s failed: %s", name, reason)
            return True
        return False

    def _persist_state(self, name: str, state: State, reason: str | None) -> None:
        self.update_record(name, state=state.value, failed_reason=reason)   # no record yet: nothing

    def settle(self, name: str, state: State, reason: str | None = None, *, user_paused: bool = False) -> Slot:
        """Give ``name`` a fresh slot in ``state`` (reconcile at start), written to its record."""
        slot = self.slots.add(name, state, reason, replace=True)
        slot.user_paused = user_paused
        self._persist_state(name, slot.state, slot.reason)
        return slot

    def update_record(self, name: str, **fields: object) -> SandboxRecord | None:
        """Change fields of a sandbox's record on disk (None if it has none)."""
        with self._records_mu:
            try:
                rec = self.sandboxes.get(name)
            except SandboxNotFound:
                return None
            for k, v in fields.items():
                setattr(rec, k, v)
            self.sandboxes.save(rec)
        if self.on_record_change is not None:
            self.on_record_change(name)
        return rec

    # -- records and domains ----------------------------------------------------------------
    def record(self, name: str) -> SandboxRecord:
        """The sandbox's record; SandboxNotFound if there is none."""
        return self.sandboxes.get(name)

    def domain(self, name: str) -> Domain:
        """The domain of a recorded sandbox; SandboxNotFound if either is missing."""
        self.record(name)
        try:
            return self.host.get_domain(name)
        except DomainNotFound:
            raise SandboxNotFound(name) from None

    def clones_of(self, template: str) -> list[str]:
        return [r.name for r in self.sandboxes.list() if r.template == template]

    def forget(self, name: str) -> None:
        """Drop the scheduling state and retire the slot of a sandbox that goes away."""
        self.sched.pop(name, None)
        self.exits.forget(name)
        self.slots.remove(name)
        for hook in self.on_forget:
            hook(name)

