"""The metadata writer: coalesced background writes that never fail an operation."""

from __future__ import annotations

import threading
import time

from azqemu.daemon.domainmeta import MetadataWriter
from azqemu.errors import DomainNotFound


def test_writes_what_is_true_when_it_runs() -> None:
    state = {"a": "running"}
    written: list[tuple[str, dict[str, str], dict[str, str] | None]] = []
    w = MetadataWriter(lambda n: ({"state": state[n]}, {"task": "1"}),
                       lambda n, attrs, labels: written.append((n, attrs, labels)))
    w.start()
    try:
        state["a"] = "compressed"
        w.request("a")
        assert w.flush()
    finally:
        w.stop()
    assert written[-1] == ("a", {"state": "compressed"}, {"task": "1"})


def test_gone_sandbox_is_not_written() -> None:
    written: list[str] = []
    w = MetadataWriter(lambda n: None, lambda n, a, lab: written.append(n))
    w.write_now("x")
    assert written == []


def test_write_failure_is_logged_not_raised(caplog) -> None:  # type: ignore[no-untyped-def]
    def boom(_n: str, _a: dict[str, str], _l: dict[str, str] | None) -> None:
        raise DomainNotFound("x")

    def crash(_n: str, _a: dict[str, str], _l: dict[str, str] | None) -> None:
        raise RuntimeError("libvirt exploded")

    MetadataWriter(lambda n: ({}, None), boom).write_now("x")
    with caplog.at_level("WARNING"):
        MetadataWriter(lambda n: ({}, None), crash).write_now("x")
    assert "metadata not updated" in caplog.text


def test_request_never_blocks_on_a_slow_write() -> None:
    gate = threading.Event()
    w = MetadataWriter(lambda n: ({}, None), lambda n, a, lab: gate.wait(5))
    w.start()
    try:
        for _ in range(100):
            w.request("a")        # returns at once while the writer waits in libvirt
        gate.set()
        assert w.flush()
    finally:
        w.stop()


def test_a_burst_of_changes_is_one_write_of_the_last_state() -> None:
    state = {"a": "running"}
    written: list[dict[str, str]] = []
    w = MetadataWriter(lambda n: ({"state": state[n]}, None), lambda n, attrs, labels: written.append(attrs),
                       coalesce_s=0.3)
    w.start()
    try:
        for s in ("compressing", "compressed", "resuming", "running", "compressing"):
            state["a"] = s
            w.request("a")
            time.sleep(0.01)
        deadline = time.monotonic() + 5
        while not written and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.4)              # a second write would have come by now
    finally:
        w.stop()
    assert written == [{"state": "compressing"}]


def test_requests_do_not_postpone_a_write() -> None:
    times: list[float] = []
    w = MetadataWriter(lambda n: ({}, None), lambda n, a, lab: times.append(time.monotonic()), coalesce_s=0.2)
    w.start()
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:      # a sandbox that changes all the time
            w.request("a")
            time.sleep(0.02)
    finally:
        w.stop()
    # Written about every 0.2 s, not once at the end (or never).
    assert len(times) >= 3 and times[0] - t0 < 0.5


def test_flush_writes_without_the_wait() -> None:
    written: list[str] = []
    w = MetadataWriter(lambda n: ({}, None), lambda n, a, lab: written.append(n), coalesce_s=30.0)
    w.start()
    try:
        w.request("a")
        w.request("b")
        t0 = time.monotonic()
        assert w.flush(timeout_s=5)
        assert time.monotonic() - t0 < 2
    finally:
        w.stop()
    assert written == ["a", "b"]
