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
