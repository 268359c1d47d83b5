"""The daemon's socket server: root only, one thread per connection, one request each.

The socket is /run/azqemu/azqemu.sock (mode 0600); a peer that is not root is refused by its
credentials (SO_PEERCRED) as well. Errors raised by operations travel back as data: azqemu
errors with their class name and exit code, anything else as an internal error whose
traceback stays in the daemon's log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import socketserver
import struct
import sys
import threading
from pathlib import Path
from typing import Any

from azqemu import config as config_mod
from azqemu.daemon import metrics, protocol, requests
from azqemu.daemon.manager import Manager
from azqemu.errors import AzqemuError, DaemonError

GIL_SWITCH_INTERVAL_S = 0.001
# A client has this long to send its request line; the reply may take as long as the
# operation (a template build: minutes), but a peer that never reads it is dropped after this.
REQUEST_READ_TIMEOUT_S = 30.0
REPLY_WRITE_TIMEOUT_S = 60.0
# Connections served at once (each a thread); more get one error line at once.
MAX_CONNECTIONS = 64

log = logging.getLogger(__name__)


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        creds = self.request.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _pid, uid, _gid = struct.unpack("3i", creds)
        if uid != 0:
            self._reply({"ok": False, "error": {"type": "PermissionError",
                                                "message": "the azqemu daemon serves root only",
                                                "exit_code": 1}})
            return
        if not self.server.slots.acquire(blocking=False):
            self._reply({"ok": False, "error": {"type": "DaemonBusy", "exit_code": 1,
                                                "message": f"the daemon serves {MAX_CONNECTIONS} connections "
                                                           "already; try again"}})
            return
        try:
            self._serve_one()
        finally:
            self.server.slots.release()

    def _serve_one(self) -> None:
        self.request.settimeout(REQUEST_READ_TIMEOUT_S)
        try:
            line = self.rfile.readline(protocol.MAX_LINE_BYTES + 1)
        except OSError:
            return  # silent or vanished client
        if not line:
            return
        try:
            if len(line) > protocol.MAX_LINE_BYTES or not line.endswith(b"\n"):
                raise ValueError(f"request line longer than {protocol.MAX_LINE_BYTES} bytes")
            req = protocol.decode(line)
            op = req.get("op", "")
            args = req.get("args") or {}
            if not isinstance(op, str):
                raise ValueError("op must be a string")
            if not isinstance(args, dict):
                raise ValueError("args must be an object")
        except (ValueError, RecursionError) as exc:
            message = str(exc) if isinstance(exc, ValueError) else "request nested too deeply"
            self._reply({"ok": False, "error": {"type": "ProtocolError", "message": message, "exit_code": 2}})
            return
        self.request.settimeout(None)   # the operation may take minutes
        reply = self.server.dispatch(op, args)
        self.request.settimeout(REPLY_WRITE_TIMEOUT_S)
        self._reply(reply)

    def _reply(self, obj: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self.wfile.write(protocol.encode(obj))


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    manager: Manager
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def dispatch(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        fn = getattr(self.manager, f"op_{op}", None) if op.isascii() and op.replace("_", "").isalnum() else None
        if fn is None:
            shown = op if len(op) <= 40 else op[:40] + "..."
            return {"ok": False, "error": {"type": "ProtocolError", "message": f"unknown operation {shown!r}",
                                           "exit_code": 2}}
        try:
            requests.check_args(op, args)
            return {"ok": True, "result": fn(**args)}
        except AzqemuError as exc:
            log.info("op %s failed: %s", op, exc, exc_info=log.isEnabledFor(logging.DEBUG))
            return {"ok": False, "error": {"type": type(exc).__name__, "message": str(exc),
                                           "exit_code": exc.exit_code}}
        except TypeError as exc:
            return {"ok": False, "error": {"type": "ProtocolError", "message": f"bad arguments for {op}: {exc}",
                                           "exit_code": 2}}
        except Exception as exc:  # noqa: BLE001 - the daemon must survive any one request
            log.exception("op %s crashed", op)
            return {"ok": False, "error": {"type": "InternalError",
                                           "message": f"internal error in {op}: {type(exc).__name__}: {exc}",
                                           "exit_code": 70}}


def serve(socket_path: Path | None = None) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    cfg = config_mod.load()
    path = socket_path or cfg.daemon_socket
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o755)
    if path.exists():
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(str(path))
            raise DaemonError(f"a daemon already serves {path}")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)
        finally:
            probe.close()
    # Fault handler threads serve vCPUs that wait: let them take the GIL from a busy
    # thread (compression, a client request) within a millisecond, not CPython's 5 ms.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    manager = Manager(cfg)
    metrics_listener = metrics.listen_from_env(manager)  # AZQ_METRICS_ADDR, off by default
    old_umask = os.umask(0o177)
    try:
        server = _Server(str(path), _Handler)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    server.manager = manager
    manager.start()
    stop = threading.Event()

    def _stop(_sig: int, _frame: object) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    log.info("azqemu daemon %d serving %s", os.getpid(), path)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        path.unlink(missing_ok=True)
        if metrics_listener is not None:
            metrics_listener.close()
        manager.close()
        log.info("azqemu daemon stopped")
