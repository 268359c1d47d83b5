"""Sandbox state in the domain's ``<metadata>``, so libvirt's own tools see what azqemu knows.

``virsh dumpxml`` of a sandbox shows an ``<azq:sandbox>`` element written at creation (role,
template, sharing domain, RAM mode). ``MetadataWriter`` keeps its changing attributes current:
the lifecycle ``state`` (a compressed sandbox is not merely "paused"), ``policy``, ``phase``,
``compressed`` (yes/no), ``stored-bytes`` (after each compress and resume) and the labels as
``<azq:label>`` children, as a Nova-style tool would read them.

Writes go through one background thread. A state change happens under the slot's small mutex
(daemon/states.py), and a libvirt call there could wait behind a libvirt job blocked on an
unserved fault; so a change only queues the sandbox's name, and the thread writes what is
true when it gets to it (changes in between coalesce into one write). A write that fails is
logged and forgotten: metadata is a view, never a reason for an operation to fail.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from azqemu.errors import AzqemuError
from azqemu.host.threads import os_named

log = logging.getLogger(__name__)

# Gives the attributes and labels to write for a sandbox, or None when it has gone.
Describe = Callable[[str], "tuple[dict[str, str], dict[str, str] | None] | None"]
# Writes them to the domain (virt.host.Domain.set_metadata behind a lookup by name).
Write = Callable[[str, dict[str, str], "dict[str, str] | None"], None]


class MetadataWriter:
    def __init__(self, describe: Describe, write: Write) -> None:
        self._describe = describe
        self._write = write
        self._pending: dict[str, None] = {}   # insertion-ordered set of names
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._thread: threading.Thread | None = None

    def request(self, name: str) -> None:
        """Write ``name``'s metadata soon (from any thread, under any lock: never blocks)."""
        with self._cv:
            self._pending[name] = None
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
        """Wait until every requested write is done (tests); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout=timeout_s)

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

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending or self._stop)
                if self._stop:
                    return
                name = next(iter(self._pending))
                del self._pending[name]
                self._busy = True
            try:
                self.write_now(name)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
