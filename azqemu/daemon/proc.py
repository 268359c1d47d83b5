"""Start the manager daemon as a child process when none runs (for the demo and the tests)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

from azqemu import config as config_mod
from azqemu.client import Client
from azqemu.errors import DaemonError, DaemonUnavailable

READY_TIMEOUT_S = 60.0


def running() -> bool:
    try:
        with Client(timeout_s=5) as c:
            c.ping()
        return True
    except DaemonUnavailable:
        return False


def start(log_path: str | None = None) -> subprocess.Popen[bytes]:
    """Start ``azq daemon`` and wait until it answers. The daemon logs to its own log
    (``Config.daemon_log``); its stdout and stderr go there too, for a crash before logging."""
    cfg = config_mod.load()
    if running():
        raise DaemonError(f"a daemon already serves {cfg.daemon_socket}")
    log_path = log_path or str(cfg.daemon_log)
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "azqemu", "daemon"], stdout=log, stderr=log,
                                start_new_session=True)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DaemonError(f"the daemon exited with {proc.returncode} at start (see {log_path})")
        if running():
            return proc
        time.sleep(0.1)
    stop(proc)
    raise DaemonError(f"the daemon did not answer within {READY_TIMEOUT_S:g} s (see {log_path})")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Stop a process this one started (a daemon, or a service a test started), by its pid
    only: SIGTERM, then SIGKILL after ``timeout_s``."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def ensure_daemon() -> Iterator[None]:
    """Use the running daemon, or run one for the duration of the block."""
    if running():
        yield
        return
    proc = start()
    try:
        yield
    finally:
        stop(proc)
