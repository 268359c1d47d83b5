"""libvirt's domain lifecycle events, as plain (name, event, detail) strings.

``LifecycleEvents`` opens a read-only connection of its own (libvirt delivers events only
to connections opened after an event loop was registered; the ``Host`` connection may be
older), runs libvirt's default event loop in a thread, and calls ``on_event(name, event,
detail)`` from that thread for every lifecycle event of every domain, e.g. ``("base-0",
"stopped", "destroyed")`` after ``virsh destroy base-0``. The callback must return quickly
(the daemon queues the work). If libvirtd restarts, the connection is opened again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import libvirt

from azqemu.host.threads import os_named

log = logging.getLogger(__name__)

EVENTS = {
    libvirt.VIR_DOMAIN_EVENT_DEFINED: ("defined", ("added", "updated", "renamed", "snapshot")),
    libvirt.VIR_DOMAIN_EVENT_UNDEFINED: ("undefined", ("removed", "renamed")),
    libvirt.VIR_DOMAIN_EVENT_STARTED: ("started", ("booted", "migrated", "restored", "snapshot", "wakeup")),
    libvirt.VIR_DOMAIN_EVENT_SUSPENDED: ("suspended", ("paused", "migrated", "ioerror", "watchdog", "restored",
                                                       "snapshot", "api-error", "postcopy", "postcopy-failed")),
    libvirt.VIR_DOMAIN_EVENT_RESUMED: ("resumed", ("unpaused", "migrated", "snapshot", "postcopy",
                                                   "postcopy-failed")),
    libvirt.VIR_DOMAIN_EVENT_STOPPED: ("stopped", ("shutdown", "destroyed", "crashed", "migrated", "saved",
                                                   "failed", "snapshot")),
    libvirt.VIR_DOMAIN_EVENT_SHUTDOWN: ("shutdown", ("finished", "guest", "host")),
    libvirt.VIR_DOMAIN_EVENT_PMSUSPENDED: ("pmsuspended", ("memory", "disk")),
    libvirt.VIR_DOMAIN_EVENT_CRASHED: ("crashed", ("panicked", "crashloaded")),
}
# The event loop wakes this often to notice stop() and a lost connection.
TICK_MS = 250
RECONNECT_S = 1.0

_impl_lock = threading.Lock()
_impl_registered = False

OnEvent = Callable[[str, str, str], None]


def describe(event: int, detail: int) -> tuple[str, str]:
    """libvirt's event and detail numbers as names (unknown ones as their numbers)."""
    name, details = EVENTS.get(event, (str(event), ()))
    return name, details[detail] if 0 <= detail < len(details) else str(detail)


def _register_impl() -> None:
    global _impl_registered
    with _impl_lock:
        if not _impl_registered:
            libvirt.virEventRegisterDefaultImpl()
            _impl_registered = True


class LifecycleEvents:
    def __init__(self, uri: str, on_event: OnEvent) -> None:
        self.uri = uri
        self.on_event = on_event
        self._conn: libvirt.virConnect | None = None
        self._cb_id: int | None = None
        self._stop = threading.Event()
        self._lost = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = threading.Event()

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the loop and subscribe; returns once subscribed (or logs why not)."""
        _register_impl()
        self._thread = threading.Thread(target=os_named(self._run), name="azq-libvirt-events", daemon=True)
        self._thread.start()
        if not self._connected.wait(timeout_s):
            log.warning("libvirt events: not subscribed within %.0f s; retrying in the background", timeout_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._disconnect()

    def _run(self) -> None:
        libvirt.virEventAddTimeout(TICK_MS, lambda _timer, _opaque: None, None)
        next_try = 0.0
        while not self._stop.is_set():
            if self._conn is None or self._lost.is_set():
                if time.monotonic() >= next_try:
                    self._disconnect()
                    self._connect()
                    next_try = time.monotonic() + RECONNECT_S
            try:
                libvirt.virEventRunDefaultImpl()
            except libvirt.libvirtError as exc:  # the loop itself failing is rare; do not spin
                log.warning("libvirt event loop: %s", exc)
                self._stop.wait(RECONNECT_S)

    def _connect(self) -> None:
        self._lost.clear()
        try:
            conn = libvirt.openReadOnly(self.uri)
            conn.registerCloseCallback(self._on_close, None)
            self._cb_id = conn.domainEventRegisterAny(None, libvirt.VIR_DOMAIN_EVENT_ID_LIFECYCLE,
                                                      self._on_lifecycle, None)
            self._conn = conn
            self._connected.set()
            log.info("libvirt events: subscribed to domain lifecycle events on %s", self.uri)
        except libvirt.libvirtError as exc:
            log.warning("libvirt events: cannot subscribe on %s: %s", self.uri, exc.get_error_message())
            self._conn = None

    def _disconnect(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            if self._cb_id is not None:
                conn.domainEventDeregisterAny(self._cb_id)
            conn.unregisterCloseCallback()
            conn.close()
        except libvirt.libvirtError:
            pass
        self._cb_id = None

    def _on_close(self, _conn: Any, reason: int, _opaque: Any) -> None:
        log.warning("libvirt events: connection closed (reason %d); reconnecting", reason)
        self._lost.set()

    def _on_lifecycle(self, _conn: Any, dom: Any, event: int, detail: int, _opaque: Any) -> None:
        name, what = describe(event, detail)
        try:
            self.on_event(dom.name(), name, what)
        except Exception:  # noqa: BLE001 - the event loop thread must survive any callback
            log.exception("libvirt events: handling %s %s of a domain failed", name, what)
