"""The agent links under a guest that floods its channel: bounded reading, the others still heard."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

from azqemu.sched.agent_channel import BURST_BYTES, RATE_BYTES_PER_S, AgentChannel
from azqemu.sched.agentlink import READ_BYTES, AgentLinks


def _server(path: Path) -> socket.socket:
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)
    return srv


def test_byte_budget_of_a_channel() -> None:
    now = [0.0]
    ch = AgentChannel("s", clock=lambda: now[0], rate_bytes_per_s=1000.0, burst_bytes=4000)
    assert ch.read_allowance() == 4000
    ch.feed(b"\n" * 4000)                      # bare newlines cost bytes too
    assert ch.read_allowance() == 0 and ch.stats.throttled == 1
    assert abs(ch.resume_in_s(500) - 0.5) < 1e-9
    now[0] = 1.0
    assert ch.read_allowance() == 1000


def test_a_flooding_guest_is_read_at_its_budget_and_a_quiet_one_still_heard(tmp_path: Path) -> None:
    paths = {"flood": tmp_path / "flood.sock", "quiet": tmp_path / "quiet.sock"}
    servers = {n: _server(p) for n, p in paths.items()}
    got: list[tuple[str, str]] = []
    links = AgentLinks(lambda: dict(paths), lambda name, msg: got.append((name, msg.event)))
    links.start()
    try:
        conns = {n: s.accept()[0] for n, s in servers.items()}
        conns["flood"].setblocking(False)
        sent, t0 = 0, time.monotonic()
        stop = threading.Event()

        def flood() -> None:
            nonlocal sent
            while not stop.is_set():
                try:
                    sent += conns["flood"].send(b"\n" * 65536)
                except BlockingIOError:
                    time.sleep(0.001)

        th = threading.Thread(target=flood, daemon=True)
        th.start()
        time.sleep(0.5)
        msg = {"v": 1, "seq": 0, "t": 1.0, "event": "idle", "phase": "wait", "tools": 0}
        conns["quiet"].sendall(json.dumps(msg).encode() + b"\n")
        time.sleep(1.5)
        stop.set()
        th.join(5)
        elapsed = time.monotonic() - t0
        stats = links.stats("flood")
        assert stats is not None
        # Everything the reader took from the flooding guest fits its byte budget.
        read = stats["lines"]               # one line per newline
        assert read <= BURST_BYTES + RATE_BYTES_PER_S * elapsed + READ_BYTES
        assert stats["throttled"] >= 1 and sent > read
        assert ("quiet", "idle") in got
    finally:
        links.stop()
        for s in servers.values():
            s.close()


def test_send_connects_at_once_and_writes_the_line_made_then(tmp_path: Path) -> None:
    """A command to a sandbox the reader has not connected to yet (a clone's first resume,
    before the next rescan) connects first; the line is made when written; a sandbox with no
    socket, or whose socket nobody listens on, gets False; its answer is read as any line."""
    paths = {"a": tmp_path / "a.sock", "gone": tmp_path / "gone.sock"}
    srv = _server(paths["a"])
    got: list[tuple[str, str]] = []
    links = AgentLinks(lambda: dict(paths), lambda name, msg: got.append((name, msg.event)))
    made: list[int] = []
    try:
        assert links.send("a", lambda: made.append(1) or b'{"cmd":"state"}\n')   # reader not started
        conn = srv.accept()[0]
        conn.settimeout(5)
        assert conn.recv(100) == b'{"cmd":"state"}\n' and made == [1]
        assert not links.send("gone", lambda: b"x\n") and not links.send("nobody", lambda: b"x\n")
        links.start()
        answer = {"v": 1, "seq": 0, "t": 1.0, "event": "clock", "phase": "wait", "set": True, "skew_ms": 2.5}
        conn.sendall(json.dumps(answer).encode() + b"\n")
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [("a", "clock")]
        stats = links.stats("a")
        assert stats is not None and stats["clock_steps"] == 1 and stats["clock_skew_ms_last"] == 2.5
        conn.close()
    finally:
        links.stop()
        srv.close()
