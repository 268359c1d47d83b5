"""Domains that stop outside azqemu, noticed at once (libvirt lifecycle events).

A sandbox destroyed with ``virsh destroy``, or whose QEMU crashed or was killed, used to
show as ``gone`` until the daemon restarted (``reconcile`` drops it then). The watcher
subscribes to libvirt's lifecycle events (``virt/events.py``) and, when a domain with a
record stops, does at once what reconcile would: stops serving its memory, frees its pages
in the store, forgets its scheduling state, removes its record and per-VM directory.

Events arrive on libvirt's event thread and are only queued there; one worker thread does
the work under the sandbox's lock, so a destroy or clone azqemu itself is doing finishes
first (its own destroy removes the record: the event then finds nothing to do). The events
of sandboxes go into the daemon's event log (``daemon/eventlog.py``, ``source="libvirt"``;
a release is azqemu's own, ``released``) and ``lost_total`` counts the sandboxes lost this
way, by cause.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Protocol

from azqemu.daemon.eventlog import LIBVIRT, EventLog
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.errors import AzqemuError, DomainNotFound
from azqemu.host.threads import os_named
from azqemu.virt.identity import remove_vm_dir

log = logging.getLogger(__name__)

# Events after which a domain may be gone: its state is checked before anything is done.
ENDINGS = frozenset({"stopped", "undefined", "crashed"})
LIVE_STATES = frozenset({"running", "paused", "blocked", "pmsuspended"})


class EventSource(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class DomainWatcher:
    def __init__(self, registry: Registry, memory: MemoryService,
                 source_factory: Callable[[Callable[[str, str, str], None]], EventSource] | None = None,
                 eventlog: EventLog | None = None) -> None:
        self.reg = registry
        self.memory = memory
        self.eventlog = eventlog if eventlog is not None else EventLog()
        self._source_factory = source_factory
        self._source: EventSource | None = None
        self._queue: queue.Queue[tuple[str, str, str] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self.lost_total: collections.Counter[str] = collections.Counter()

    def start(self) -> None:
        self._worker = threading.Thread(target=os_named(self._work), name="azq-domain-watch", daemon=True)
        self._worker.start()
        factory = self._source_factory
        if factory is None:
            from azqemu.virt.events import LifecycleEvents

            uri = self.reg.cfg.libvirt_uri
            def factory(cb: Callable[[str, str, str], None]) -> EventSource:
                return LifecycleEvents(uri, cb)
        try:
            self._source = factory(self.on_event)
            self._source.start()
        except Exception as exc:  # noqa: BLE001 - without events the daemon still works (reconcile)
            log.warning("libvirt lifecycle events unavailable: %s", exc)

    def stop(self) -> None:
        if self._source is not None:
            with contextlib.suppress(Exception):
                self._source.stop()
        self._queue.put(None)
        if self._worker is not None:
            self._worker.join(timeout=10)

    def on_event(self, name: str, event: str, detail: str) -> None:
        """From libvirt's event thread: note it, queue the work, return at once."""
        if not self.reg.sandboxes.path(name).exists():
            return  # not one of ours (another manager's, a template build, a foreign domain)
        self.eventlog.publish(name, event, detail, source=LIBVIRT)
        if event in ENDINGS:
            self._queue.put((name, event, detail))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self.handle_ending(*item)
            except Exception:  # noqa: BLE001 - one bad event must not stop the watcher
                log.exception("handling %s of %s failed", item[1], item[0])

    def handle_ending(self, name: str, event: str, detail: str) -> bool:
        """The domain of ``name`` stopped or vanished: release the sandbox unless azqemu
        already did (or the domain runs again). Returns whether it was released."""
        reg = self.reg
        with reg.lock(name):
            if not reg.sandboxes.path(name).exists():
                return False  # azqemu destroyed it itself (or a failed clone was cleaned up)
            try:
                state = reg.host.get_domain(name).state()
            except DomainNotFound:
                state = "gone"
            except AzqemuError as exc:
                log.warning("%s: %s %s, but its state cannot be read (%s): left alone", name, event, detail, exc)
                return False
            if state in LIVE_STATES:
                return False
            cause = f"{event}-{detail}"
            log.warning("sandbox %s ended outside azqemu (%s, domain %s): releasing it", name, cause, state)
            self.memory.cancel(name, for_good=True)
            self.memory.release(name)
            self.memory.domain_gone(name)       # not live: its tombstone has nothing to guard
            remove_vm_dir(name)
            reg.sandboxes.remove(name)
            # Last: a slot asked for meanwhile is made again from the record while it exists,
            # and would then outlive it and keep the name taken.
            reg.forget(name)
            self.lost_total[detail if event == "stopped" else event] += 1
            self.eventlog.publish(name, "released", cause)
            return True

    def events(self, since: float = 0.0) -> list[dict[str, Any]]:
        return self.eventlog.events(since)
