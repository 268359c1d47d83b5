"""QMP to a domain's own monitor socket, through qemu.qmp: the only module importing it.

Choice: every azqemu domain gets a second QMP monitor of its own (``-qmp unix:...`` in the
domain's ``<qemu:commandline>``) instead of libvirt's QMP passthrough
(``qemuMonitorCommand``). Why: (1) migration commands (``migrate`` with ``x-ignore-shared``,
``migrate-incoming`` on a ``-incoming defer`` clone) are exactly what libvirt does not model,
and passthrough would taint the domain ``custom-monitor`` and serialise behind libvirt's
monitor lock, which blocks while QEMU's main thread waits on a userfaultfd fault; (2) our
socket gives us QMP events (VSERPORT_CHANGE, MIGRATION) without libvirt's event loop;
(3) qemu.qmp is QEMU's own, maintained client. libvirt keeps its monitor for everything it
models (start, pause, resume, destroy). The legacy synchronous facade of qemu.qmp is used; it
binds an event loop per thread, so a ``Monitor`` must stay in the thread that opened it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from qemu.qmp import ExecuteError
from qemu.qmp import QMPError as _LibQMPError
from qemu.qmp.legacy import QEMUMonitorProtocol

from azqemu.errors import QMPError

log = logging.getLogger(__name__)

# QEMU creates the monitor socket while it starts; under TCG with libvirt that is well under
# a second, 10 s covers a loaded host.
CONNECT_TIMEOUT_S = 10.0
COMMAND_TIMEOUT_S = 30.0


class Monitor:
    """A synchronous QMP connection (use as a context manager)."""

    def __init__(self, socket_path: Path, *, connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        deadline = time.monotonic() + connect_timeout_s
        last: Exception | None = None
        while True:
            qmp = QEMUMonitorProtocol(str(socket_path))
            try:
                qmp.connect(negotiate=True)
                break
            except (OSError, _LibQMPError) as exc:
                last = exc
                qmp.close()
                if time.monotonic() > deadline:
                    raise QMPError(f"cannot connect to QMP at {socket_path}: {last}") from exc
                time.sleep(0.02)
        qmp.settimeout(COMMAND_TIMEOUT_S)
        self._qmp = qmp

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._qmp.close()

    def execute(self, command: str, **arguments: Any) -> Any:
        """Run one QMP command; a QMP error becomes ``QMPError`` with its error class."""
        try:
            return self._qmp.cmd(command, **arguments)
        except ExecuteError as exc:
            raise QMPError(f"QMP {command} failed: {exc.error.error.desc}", exc.error.error.class_) from exc
        except (OSError, _LibQMPError, TimeoutError) as exc:
            raise QMPError(f"QMP {command} failed: {exc}") from exc

    def set_migration_capabilities(self, **caps: bool) -> None:
        self.execute("migrate-set-capabilities",
                     capabilities=[{"capability": k.replace("_", "-"), "state": v} for k, v in caps.items()])

    def wait_migration(self, timeout_s: float, poll_s: float = 0.005) -> dict[str, Any]:
        """Poll query-migrate until completed; raise on failed/cancelled/timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.execute("query-migrate")
            status = info.get("status")
            if status == "completed":
                return dict(info)
            if status in ("failed", "cancelled"):
                raise QMPError(f"migration {status}: {info.get('error-desc', 'no detail')}")
            if time.monotonic() > deadline:
                raise QMPError(f"migration not completed within {timeout_s:g} s (status {status})")
            time.sleep(poll_s)
            poll_s = min(poll_s * 1.5, 0.05)
