"""The manager's end of every sandbox's in-guest agent channel (org.azqemu.agent.0).

libvirt binds each sandbox's channel to a unix socket in its socket directory; one thread
here connects to all of them, reads what the guests write, validates it with
``agent_channel.AgentChannel`` (bounded, rate limited, strict schema) and turns accepted
messages into phase observations of that same sandbox only. A channel whose byte budget is
spent is not read (taken out of the selector) until its budget refills: backpressure on that
guest alone, the others are read as before.

``send`` writes a host command (the clock after a resume) to a sandbox's channel from any
thread, connecting to it first if the reader has not yet (a clone's first tool call comes
before the next rescan).
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from azqemu.host.threads import os_named
from azqemu.sched.agent_channel import AgentChannel, AgentMessage

log = logging.getLogger(__name__)

READ_BYTES = 4096
RESCAN_S = 1.0


class AgentLinks:
    """Connects to each sandbox's agent socket; ``on_message(sandbox, msg)`` per message."""

    def __init__(self, sockets: Callable[[], dict[str, Path]],
                 on_message: Callable[[str, AgentMessage], None]) -> None:
        self._sockets = sockets
        self._on_message = on_message
        self._sel = selectors.DefaultSelector()
        self._conns: dict[str, tuple[socket.socket, AgentChannel]] = {}
        self._paused: dict[str, float] = {}   # sandbox -> monotonic time to read it again
        # Held while connections are made or dropped, and while a command is written: send()
        # runs on other threads than the reader's.
        self._mu = threading.RLock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=os_named(self._run), name="azq-agent-links", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s, _ in self._conns.values():
            s.close()
        self._sel.close()

    def stats(self, sandbox: str) -> dict[str, object] | None:
        conn = self._conns.get(sandbox)
        return conn[1].stats.as_dict() if conn else None

    def send(self, sandbox: str, line_of: Callable[[], bytes]) -> bool:
        """Write ``line_of()`` (made at the moment of writing) to the sandbox's agent; False
        when it has no channel (no socket, nobody listening) or the write did not go through
        whole (a full socket buffer: a guest that does not read; the command is not retried)."""
        with self._mu:
            conn = self._conns.get(sandbox)
            if conn is None:
                path = self._sockets().get(sandbox)
                conn = self._connect(sandbox, path) if path is not None else None
            if conn is None:
                return False
            line = line_of()
            try:
                return conn[0].send(line) == len(line)
            except OSError:
                return False

    def _rescan(self) -> None:
        wanted = self._sockets()
        with self._mu:
            for name in list(self._conns):
                if name not in wanted:
                    self._drop(name)
            for name, path in wanted.items():
                if name not in self._conns:
                    self._connect(name, path)

    def _connect(self, name: str, path: Path) -> tuple[socket.socket, AgentChannel] | None:
        if not path.exists():
            return None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
        except OSError:
            s.close()
            return None
        conn = self._conns[name] = (s, AgentChannel(name))
        self._sel.register(s, selectors.EVENT_READ, name)
        return conn

    def _drop(self, name: str) -> None:
        with self._mu:
            conn = self._conns.pop(name, None)
            self._paused.pop(name, None)
        if conn is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(conn[0])
        conn[0].close()

    def _pause(self, name: str, s: socket.socket, ch: AgentChannel) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(s)
        self._paused[name] = time.monotonic() + ch.resume_in_s(READ_BYTES)

    def _unpause_due(self) -> float:
        """Read again the channels whose budget is back; returns seconds to the next one due."""
        now, nearest = time.monotonic(), RESCAN_S
        for name, due in list(self._paused.items()):
            if due <= now:
                del self._paused[name]
                self._sel.register(self._conns[name][0], selectors.EVENT_READ, name)
            else:
                nearest = min(nearest, due - now)
        return nearest

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._rescan()
            except Exception:  # noqa: BLE001 - keep listening to the others
                log.exception("agent link rescan failed")
            timeout = self._unpause_due()
            for key, _ in self._sel.select(timeout=timeout) if len(self._conns) > len(self._paused) else []:
                name = key.data
                s, ch = self._conns[name]
                allowance = ch.read_allowance()
                if allowance < 1:
                    self._pause(name, s, ch)
                    continue
                try:
                    data = s.recv(min(READ_BYTES, allowance))
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self._drop(name)
                    continue
                for msg in ch.feed(data):
                    self._on_message(name, msg)
            if len(self._conns) <= len(self._paused):
                self._stop.wait(timeout)
