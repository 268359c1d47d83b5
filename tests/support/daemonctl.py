"""Stopping and starting the integration tests' daemon (the session fixture's process), with
crash or fault points set for the new one (azqemu/memory/crashpoint.py)."""

from __future__ import annotations

import os
import subprocess

from azqemu import config as config_mod
from azqemu.daemon import proc as daemonproc
from azqemu.errors import DaemonError


def start() -> subprocess.Popen[bytes]:
    """Start a daemon; a failure says what the daemon's log ends with."""
    try:
        return daemonproc.start()
    except DaemonError as exc:
        log = config_mod.load().daemon_log.read_text()[-4000:]
        raise AssertionError(f"{exc}\n{log}") from exc


def restart(daemon: dict, crash_at: str | None = None, fail_at: str | None = None,
            env: dict[str, str] | None = None) -> None:
    """Stop the fixture's daemon and start a new one with ``AZQ_CRASH_AT``/``AZQ_FAIL_AT`` and
    ``env`` set (for the new one only)."""
    daemonproc.stop(daemon["proc"])
    extra = {"AZQ_CRASH_AT": crash_at, "AZQ_FAIL_AT": fail_at, **(env or {})}
    saved = {var: os.environ.get(var) for var in extra}
    for var, value in extra.items():
        if value:
            os.environ[var] = value
    try:
        daemon["proc"] = start()
    finally:
        for var, old in saved.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old


def start_dying(crash_at: str) -> int:
    """Start a daemon that must kill itself at ``crash_at`` while it starts (reconcile);
    returns its exit status (-SIGKILL expected)."""
    os.environ["AZQ_CRASH_AT"] = crash_at
    try:
        daemonproc.start()
    except DaemonError as exc:
        return -9 if "exited with -9" in str(exc) else 1
    finally:
        os.environ.pop("AZQ_CRASH_AT", None)
    raise AssertionError(f"the daemon started although AZQ_CRASH_AT={crash_at} should have killed it")
