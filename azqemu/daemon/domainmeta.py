"""Sandbox state in the domain's ``<metadata>``, so libvirt's own tools see what azqemu knows.

``virsh dumpxml`` of a sandbox shows an ``<azq:sandbox>`` element written at creation (role,
template, sharing domain, RAM mode). ``MetadataWriter`` keeps its changing attributes current:
the lifecycle ``state`` (a compressed sandbox is not merely "paused"), ``policy``, ``phase``,
``compressed`` (yes/no), ``stored-bytes`` (as its last compression left it) and the labels as
``<azq:label>`` children, as a Nova-style tool would read them.

Writes go through one background thread. A state change happens under the slot's small mutex
(daemon/states.py), and a libvirt call there could wait behind a libvirt job blocked on an
unserved fault; so a change only queues the sandbox's name, and the thread writes what is
true when it gets to it. A name waits COALESCE_S after its first request, so that the burst of
changes an operation makes (a compression's compressing, compressed and the wait's phase; a
resume's resuming, running and the call's phase) becomes one write. A write that fails is
logged and forgotten: metadata is a view, never a reason for an operation to fail.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from azqemu.errors import AzqemuError
from azqemu.host.threads import os_named

log = logging.getLogger(__name__)

# Gives the attributes and labels to write for a sandbox, or None when it has gone.
Describe = Callable[[str], "tuple[dict[str, str], dict[str, str] | None] | None"]
# Writes them to the domain (virt.host.Domain.set_metadata behind a lookup by name).
Write = Callable[[str, dict[str, str], "dict[str, str] | None"], None]

# How long a requested write waits for the changes that follow it. A write is three libvirt
# calls (lookup, read, setMetadata: libvirtd rewrites the domain's status file). Written at
# every change (and with the stored bytes counted afresh, a pass over the sharing domain's blob
# rows under the store's lock), a 16-sandbox coding-agent run made ~9 writes a compression and
# resume, 10% of the manager's CPU (session 33); half a second of staleness is nothing to a
# tool that reads ``virsh dumpxml``.
COALESCE_S = 0.5


class MetadataWriter:
    def __init__(self, describe: Describe, write: Write, coalesce_s: float = COALESCE_S) -> None:
        self._describe = describe
        self._write = write
        self._coalesce_s = coalesce_s
        self._pending: dict[str, float] = {}   # name -> when to write it (monotonic), in request order
        self._cv = threading.Condition()
        self._busy = False
        self._flushing = 0                      # flush() callers waiting: write without waiting
        self._stop = False
        self._thread: threading.Thread | None = None

    def request(self, name: str) -> None:
        """Write ``name``'s metadata within COALESCE_S (from any thread, under any lock: never
        blocks). A name already waiting keeps its time: requests do not postpone a write."""
        with self._cv:
            if name not in self._pending:
                self._pending[name] = time.monotonic() + self._coalesce_s
                self._cv.notify_all()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=os_named(self._run), name="azq-domain-metadata", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Write every requested name now, without its wait, and return once done (tests);
        False on timeout."""
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_s)
            finally:
                self._flushing -= 1

    def write_now(self, name: str) -> None:
        """Write ``name``'s metadata in this thread; failures are logged, never raised."""
        try:
            got = self._describe(name)
            if got is not None:
                self._write(name, *got)
        except AzqemuError as exc:   # the domain went away, libvirt refused: a view only
            log.debug("%s: metadata not updated: %s", name, exc)
        except Exception:  # noqa: BLE001 - a view must never take the daemon down
            log.warning("%s: metadata not updated", name, exc_info=True)

    def _first_due(self) -> tuple[str | None, float | None]:
        """Under the condition: the first requested name (the first due: every name waits
        the same time) and the seconds until it is due, 0 when it is (or a flush waits);
        (None, None) when none waits."""
        if not self._pending:
            return None, None
        name, due = next(iter(self._pending.items()))
        return name, 0.0 if self._flushing else max(0.0, due - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cv:
                name, wait_s = self._first_due()
                while not self._stop and wait_s != 0.0:
                    self._cv.wait(timeout=wait_s)
                    name, wait_s = self._first_due()
                if self._stop or name is None:
                    return
                del self._pending[name]
                self._busy = True
            try:
                self.write_now(name)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
