"""The daemon line of ``azq doctor``."""

from __future__ import annotations

from azqemu.errors import DaemonUnavailable
from azqemu.host.doctor import OK, WARN, daemon_check


def test_a_daemon_that_answers_gives_version_and_pid() -> None:
    c = daemon_check(lambda: (4242, "0.9.0"), "/run/azqemu/daemon.sock")
    assert (c.name, c.verdict) == ("daemon", OK)
    assert c.detail == "azqemu 0.9.0 answers at /run/azqemu/daemon.sock (pid 4242)"


def test_a_daemon_that_is_down_is_a_warning_with_advice() -> None:
    def down() -> tuple[int, str]:
        raise DaemonUnavailable("/run/azqemu/daemon.sock", "connection refused")

    c = daemon_check(down, "/run/azqemu/daemon.sock")
    assert (c.name, c.verdict) == ("daemon", WARN)
    assert c.detail == "no azqemu daemon at /run/azqemu/daemon.sock (connection refused)"
    assert "azq daemon" in c.advice
