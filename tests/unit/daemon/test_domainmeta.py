"""The metadata writer: coalesced background writes that never fail an operation."""

from __future__ import annotations

import threading

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
