"""The CLI's side of the daemon socket."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from azqemu import config as config_mod
from azqemu.daemon import protocol
from azqemu.errors import DaemonError, DaemonUnavailable, RemoteError


class Client:
    def __init__(self, socket_path: Path | None = None, timeout_s: float | None = None) -> None:
        self.socket_path = socket_path or config_mod.load().daemon_socket
        self.timeout_s = timeout_s

    def call(self, op: str, **args: Any) -> Any:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.socket_path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonUnavailable(str(self.socket_path), exc.strerror or "") from exc
        except PermissionError as exc:
            sock.close()
            raise DaemonUnavailable(str(self.socket_path), "permission denied: root only") from exc
        with sock:
            sock.sendall(protocol.encode({"op": op, "args": args}))
            f = sock.makefile("rb")
            line = f.readline(protocol.MAX_LINE_BYTES + 1)
        if not line:
            raise DaemonError(f"the daemon closed the connection during {op!r}")
        reply = protocol.decode(line)
        if reply.get("ok"):
            return reply.get("result")
        err = reply.get("error") or {}
        raise RemoteError(str(err.get("type", "Error")), str(err.get("message", "unknown error")),
                          int(err.get("exit_code", 1)))
