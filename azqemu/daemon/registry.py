"""The daemon's books: what it knows of its sandboxes besides what libvirt says.

One ``Registry`` is shared by the daemon's services: the libvirt host, the template and
sandbox records on disk, a lock per sandbox (every operation that changes a sandbox holds
it), the scheduling state of each sandbox, and which sandboxes azqemu itself paused.
libvirt stays the truth about what runs (``reconcile`` makes the books agree at start).
"""

from __future__ import annotations

import threading
from collections import defaultdict

from azqemu import config as config_mod
from azqemu.errors import DomainNotFound, SandboxNotFound
from azqemu.sched.actions import SchedState
from azqemu.virt.clones import SandboxRecord, SandboxRepo
from azqemu.virt.host import Domain, Host
from azqemu.virt.templates import TemplateRepo


class Registry:
    def __init__(self, cfg: config_mod.Config, host: Host, templates: TemplateRepo,
                 sandboxes: SandboxRepo) -> None:
        self.cfg = cfg
        self.host = host
        self.templates = templates
        self.sandboxes = sandboxes
        self._locks: dict[str, threading.RLock] = defaultdict(threading.RLock)
        self._locks_guard = threading.Lock()
        self.sched: dict[str, SchedState] = {}
        # Sandboxes azqemu itself paused (compressed): a tool call resumes them; a sandbox the
        # user paused stays paused and exec refuses it.
        self.paused_by_azq: set[str] = set()

    def lock(self, name: str) -> threading.RLock:
        with self._locks_guard:
            return self._locks[name]

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
        """Drop the scheduling state and the paused mark of a sandbox that goes away."""
        self.sched.pop(name, None)
        self.paused_by_azq.discard(name)
