"""The daemon's event log: what happened to sandboxes, newest ``RECENT_EVENTS`` kept, for
``azq events`` and ``GET /v1/events`` (recent ones, or followed as they happen).

Two sources write into it. libvirt's lifecycle events (``source="libvirt"``: started,
suspended, resumed, stopped, ...; ``daemon/watch.py``) say what the hypervisor saw; the
daemon's own (``source="azqemu"``) say what azqemu did and why: ``created``, ``phase`` (the
scheduler's view moved between tool and wait, with the ``signal`` that decided it),
``compress`` and ``resume`` (done, cancelled or failed, with their figures), ``failed``
(the reason), ``destroyed`` (by azqemu) and ``released`` (its domain ended outside azqemu).

An event is a flat JSON object: ``time`` (Unix time), ``seq`` (its order in this daemon's
life: times can tie or step back, ``seq`` does neither), ``sandbox``, ``event``, ``detail``
(one short line), ``source`` and whichever structured fields its kind has (``duration_s``,
``stored_bytes``, ``phase``, ``reason``, ...; see ``Event`` in azqemu/api/models.py).

``publish`` may be called from any thread, also with a sandbox's state mutex held (a slot
that fails publishes under it): it takes only the log's own lock, never waits, never does
I/O. Followers wait on the log's condition (threads, ``wait``) or are woken through their
event loop (``wait_async``, the API's streams): nothing polls.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

# 256 was the watcher's buffer of libvirt events alone; the daemon's own add about five per
# compress/resume cycle of a sandbox, so a few cycles of a few dozen sandboxes fit.
RECENT_EVENTS = 1024
LIBVIRT, AZQEMU = "libvirt", "azqemu"
# A field longer than this (a traceback's text in a reason) is cut: events are one-liners.
MAX_TEXT_CHARS = 500

# What a service that publishes gets: ``publish(sandbox, event, detail, **fields)``.
Publish = Callable[..., object]


def discard(*_args: Any, **_fields: Any) -> None:
    """A ``Publish`` that keeps nothing (services made without an event log: unit tests)."""


def _short(value: Any) -> Any:
    return value[:MAX_TEXT_CHARS] if isinstance(value, str) else value


class EventLog:
    """The newest events, in order, and the means to wait for the next one (thread-safe)."""

    def __init__(self, maxlen: int = RECENT_EVENTS, clock: Callable[[], float] = time.time) -> None:
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)
        self._cond = threading.Condition()
        self._clock = clock
        self._seq = 0
        # Followers in event loops: (loop, its asyncio.Event), set through the loop's thread.
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the newest event (0 before the first)."""
        with self._cond:
            return self._seq

    def publish(self, sandbox: str, event: str, detail: str = "", *, source: str = AZQEMU,
                **fields: Any) -> dict[str, Any]:
        """Add one event and wake every follower; fields that are None are left out."""
        extra = {k: _short(v) for k, v in fields.items() if v is not None}
        with self._cond:
            self._seq += 1
            e = {"time": self._clock(), "seq": self._seq, "sandbox": sandbox, "event": event,
                 "detail": _short(detail), "source": source, **extra}
            self._events.append(e)
            self._cond.notify_all()
            for loop, flag in list(self._async_waiters):
                # A loop that closed meanwhile has no follower left to wake.
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(flag.set)
        return e

    def events(self, since: float = 0.0, *, after_seq: int = 0, sandbox: str | None = None,
               kinds: Collection[str] | None = None) -> list[dict[str, Any]]:
        """Events newer than Unix time ``since`` and than ``after_seq``, oldest first, of one
        ``sandbox`` and of the event ``kinds`` if given (copies: callers may keep them)."""
        with self._cond:
            snapshot = list(self._events)
        return [dict(e) for e in snapshot
                if e["time"] > since and e["seq"] > after_seq
                and (sandbox is None or e["sandbox"] == sandbox) and (not kinds or e["event"] in kinds)]

    def wait(self, after_seq: int, timeout_s: float) -> bool:
        """Block until an event newer than ``after_seq`` exists or ``timeout_s`` passed;
        whether one exists."""
        with self._cond:
            return self._cond.wait_for(lambda: self._seq > after_seq, timeout=timeout_s)

    async def wait_async(self, after_seq: int, timeout_s: float) -> bool:
        """``wait`` for a coroutine: its event loop stays free meanwhile."""
        flag = asyncio.Event()
        waiter = (asyncio.get_running_loop(), flag)
        with self._cond:
            if self._seq > after_seq:
                return True
            self._async_waiters.add(waiter)
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(flag.wait(), timeout_s)
        finally:
            with self._cond:
                self._async_waiters.discard(waiter)
        return self.last_seq > after_seq
