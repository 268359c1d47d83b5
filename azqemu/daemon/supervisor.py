"""Supervision of the fault handlers: a dead handler is restarted, an unservable page retried,
and a sandbox whose faults cannot be served is failed with the reason, never left hanging.

A vCPU that faults on a page waits until the manager answers. Two things used to leave it
waiting for ever with only a log line: the handler thread dying (an unexpected error in its
loop), and a page its source cannot produce (``on_error``: a lost store entry, a checksum
that does not match, an ioctl that failed). One supervisor thread watches every sandbox's
``FaultHandler`` through its public API (``running``, ``last_error``, ``retry_failed``,
``stop``/``start``):

- a handler thread that died while its QEMU lives is started again (``start`` wakes every
  waiting vCPU, whose fault then reaches the new thread); more than ``MAX_RESTARTS`` deaths
  within ``RESTART_WINDOW_S`` is not transient: the sandbox is failed;
- new fault errors are retried (``retry_failed``) up to ``MAX_FAULT_RETRIES`` times, one
  ``POLL_INTERVAL_S`` apart (a passing cause such as ENOMEM in the kernel goes away); a page
  that still cannot be served then fails the sandbox, with the error as its reason. The
  faulting thread keeps waiting (a wrong page is never an answer); ``azq list`` says why and
  destroy still works (it unregisters the range first).

It polls instead of hooking ``on_error``, because the handler's callback is SandboxMemory's
(azqemu/daemon/sandboxmem.py, not this service's): a failure shows within one interval. A new
failure is a new ``last_error`` object (the handler records each one); the poll reads two
attributes per sandbox and never ``stats()``, whose percentiles cost a millisecond.

A restart goes through ``SandboxMemory.restart_handler``, whose lock a compression starting
the handler itself takes too: the handler is never started twice.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from azqemu.host.threads import os_named

log = logging.getLogger(__name__)

# How often the handlers are looked at: a failed sandbox shows in `azq list` this fast, and
# a dead handler's vCPUs wait at most this long plus the restart (~1 ms).
POLL_INTERVAL_S = 0.25
# New errors are retried this many times (one interval apart) before the sandbox is failed:
# a second is long for a guest, short enough that nothing (soft lockup at ~20 s) breaks.
MAX_FAULT_RETRIES = 4
# Handler deaths tolerated within the window; one more fails the sandbox.
MAX_RESTARTS = 3
RESTART_WINDOW_S = 60.0


class SupervisedHandler(Protocol):
    """What the supervisor uses of ``azqemu.restore.handler.FaultHandler``."""

    last_error: BaseException | None

    @property
    def running(self) -> bool: ...

    def retry_failed(self) -> int: ...

    def start(self, *, wake: bool = True) -> None: ...

    def stop(self, timeout_s: float = 5.0) -> None: ...


class _Handle(Protocol):
    @property
    def pid(self) -> int: ...


class SupervisedMemory(Protocol):
    """What the supervisor uses of ``SandboxMemory``."""

    registered: bool

    @property
    def handler(self) -> SupervisedHandler: ...

    @property
    def handle(self) -> _Handle: ...

    def restart_handler(self) -> bool: ...


@dataclass
class _Watch:
    error_seen: BaseException | None = None
    retries: int = 0
    deaths: list[float] = field(default_factory=list)
    given_up: bool = False


def pid_alive(pid: int | None) -> bool:
    """Whether QEMU still runs (an unknown pid counts as running: restart, and let the
    restart limit decide)."""
    if pid is None or pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FaultSupervisor:
    """One thread over every sandbox's fault handler (see the module docstring).

    ``sandboxes()`` lists (name, memory) to watch; ``fail(name, reason)`` fails a sandbox;
    ``guard`` is held around a restart (the memory service holds it to detach, so a handler
    is never started again on a closed uffd)."""

    def __init__(self, sandboxes: Callable[[], list[tuple[str, SupervisedMemory]]],
                 fail: Callable[[str, str], object], guard: threading.Lock, *,
                 interval_s: float = POLL_INTERVAL_S) -> None:
        self._sandboxes = sandboxes
        self._fail = fail
        self._guard = guard
        self.interval_s = interval_s
        self._watch: dict[str, tuple[SupervisedMemory, _Watch]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.restarts = 0            # handler threads started again (all sandboxes)
        self.retries = 0             # retry_failed calls
        self.failed: dict[str, str] = {}

    def ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stop.clear()
                self._thread = threading.Thread(target=os_named(self._run), name="azq-fault-supervisor", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001 - the supervisor must outlive one bad sandbox
                log.exception("fault supervision round failed")

    def check_once(self, now: float | None = None) -> None:
        """One round over every sandbox (the thread's body; tests call it directly)."""
        now = time.monotonic() if now is None else now
        live = dict(self._sandboxes())
        for name in [n for n in self._watch if n not in live or self._watch[n][0] is not live[n]]:
            del self._watch[name]       # released, or a new memory under the name
        for name, mem in live.items():
            if name not in self._watch:
                self._watch[name] = (mem, _Watch(error_seen=mem.handler.last_error))
            w = self._watch[name][1]
            if not w.given_up:
                self._check(name, mem, w, now)

    def _check(self, name: str, mem: SupervisedMemory, w: _Watch, now: float) -> None:
        h = mem.handler
        if mem.registered and not h.running and pid_alive(mem.handle.pid):
            w.deaths = [t for t in w.deaths if now - t < RESTART_WINDOW_S] + [now]
            if len(w.deaths) > MAX_RESTARTS:
                self._give_up(name, w, f"its fault handler died {len(w.deaths)} times within "
                                       f"{RESTART_WINDOW_S:g} s (last: {_describe(h.last_error)})")
                return
            with self._guard:
                if not mem.registered or h.running:
                    return                  # detached, or started again meanwhile
                log.warning("%s: fault handler died (%s): starting it again", name, _describe(h.last_error))
                if mem.restart_handler():
                    self.restarts += 1
                w.error_seen = h.last_error     # what killed the thread, not a fault's error
        error = h.last_error
        if error is not None and error is not w.error_seen:
            w.error_seen = error
            if w.retries >= MAX_FAULT_RETRIES:
                self._give_up(name, w, f"a page fault cannot be served after {w.retries} retries: "
                                       f"{_describe(h.last_error)}")
                return
            w.retries += 1
            self.retries += 1
            waiting = h.retry_failed()
            log.warning("%s: %d fault(s) could not be served (%s): retry %d of %d", name, waiting,
                        _describe(h.last_error), w.retries, MAX_FAULT_RETRIES)
        elif w.retries:
            w.retries = 0               # an interval without new errors: the cause passed

    def _give_up(self, name: str, w: _Watch, reason: str) -> None:
        w.given_up = True
        self.failed[name] = reason
        log.error("%s: %s", name, reason)
        self._fail(name, reason)


def _describe(exc: BaseException | None) -> str:
    return "no error recorded" if exc is None else f"{type(exc).__name__}: {exc}"
