"""The daemon's listeners: the ``/v1`` HTTP API (``azqemu.api``) served by uvicorn.

- The unix socket /run/azqemu/azqemu.sock (mode 0600, made under umask 0177 before anyone
  can connect). A peer that is not root is refused by its credentials (SO_PEERCRED) when it
  connects, with one 403 ``NotRoot`` reply, before any request is read.
- Opt-in, a TCP address (``AZQ_API_ADDR=host:port``): every request needs the bearer token of
  the token file (``AZQ_API_TOKEN_FILE``, default ``<state dir>/api-token``, created 0600 with
  a random token when missing); TLS when ``AZQ_API_CERT`` (and ``AZQ_API_KEY``) name a
  certificate.
- The metrics listener (``AZQ_METRICS_ADDR``, ``daemon/metrics.py``) as before, and the
  reaper of sandboxes whose time to live ended (``daemon/tags.py``).

Limits in uvicorn's terms: ``limit_concurrency`` caps connections (more get a 503 at once);
``timeout_keep_alive`` drops an idle keep-alive connection; a new connection has
``REQUEST_START_TIMEOUT_S`` to start its request. Requests in progress are capped by the API's
guard (``DaemonBusy``), bodies by their limits (``PayloadTooLarge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import struct
import sys
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from azqemu import config as config_mod
from azqemu.api.app import make_app
from azqemu.api.errors import error_info
from azqemu.api.guard import MAX_REQUESTS, Guard, Limiter
from azqemu.api.models import ErrorBody
from azqemu.daemon import metrics
from azqemu.daemon.manager import Manager
from azqemu.daemon.tags import SandboxTags, TtlReaper
from azqemu.errors import ConfigError, DaemonError, NotRoot
from azqemu.host import threads

GIL_SWITCH_INTERVAL_S = 0.001
# A new connection has this long to start its request (the old protocol's read timeout).
REQUEST_START_TIMEOUT_S = 30.0
# An idle keep-alive connection is closed after this.
KEEP_ALIVE_S = 5.0
# Connections at once over each listener: the guard's request cap plus room for idle
# keep-alive connections and event streams.
MAX_CONNECTIONS = 2 * MAX_REQUESTS
# Operations run in threads (anyio's pool); one per request the guard lets in, and a few spare.
THREADS = MAX_REQUESTS + 8
SHUTDOWN_GRACE_S = 10.0

ENV_API_ADDR = "AZQ_API_ADDR"
ENV_TOKEN_FILE = "AZQ_API_TOKEN_FILE"
ENV_CERT = "AZQ_API_CERT"
ENV_KEY = "AZQ_API_KEY"

log = logging.getLogger(__name__)


def peer_uid(sock: socket.socket) -> int:
    """The uid of a unix socket's peer (SO_PEERCRED: struct ucred {pid_t, uid_t, gid_t})."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


def _refusal(exc: Exception, status: str) -> bytes:
    body = ErrorBody(error=error_info(exc)).model_dump_json().encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class RootOnlyH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, refusing unix-socket peers that are not root, and closing
    a connection that does not start a request within REQUEST_START_TIMEOUT_S."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family == socket.AF_UNIX:
            try:
                uid = peer_uid(sock)
            except OSError:
                uid = -1
            if uid != 0:
                log.warning("refused a connection from uid %d (root only)", uid)
                transport.write(_refusal(NotRoot("the azqemu daemon's socket"), "403 Forbidden"))
                transport.close()
                return
        self.timeout_keep_alive_task = self.loop.call_later(REQUEST_START_TIMEOUT_S,
                                                            self.timeout_keep_alive_handler)


class _Server(uvicorn.Server):
    """The daemon handles SIGTERM/SIGINT itself (for every listener at once)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


@dataclass
class Listener:
    sock: socket.socket
    config: uvicorn.Config
    where: str


def _config(app: Any, **kw: Any) -> uvicorn.Config:
    return uvicorn.Config(app, http=RootOnlyH11, lifespan="off", log_config=None, access_log=False,
                          limit_concurrency=MAX_CONNECTIONS, timeout_keep_alive=int(KEEP_ALIVE_S),
                          timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S), server_header=False, **kw)


def check_free(path: Path) -> None:
    """Refuse to start beside a live daemon; remove a stale socket file."""
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


def bind_unix(path: Path) -> socket.socket:
    """The root-only socket, 0600 from its first moment (umask)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def read_token(path: Path) -> str:
    """The API token, made (0600, random) if the file does not exist; refused if others can read it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        log.info("API token written to %s", path)
    st = path.stat()
    if st.st_mode & 0o077:
        raise ConfigError(f"{path}: the API token file must not be readable by others (chmod 600)")
    token = path.read_text().strip()
    if len(token) < 16:
        raise ConfigError(f"{path}: the API token must be at least 16 characters")
    return token


def tcp_listener(app: Any, limiter: Limiter, cfg: config_mod.Config,
                 env: dict[str, str] | None = None) -> Listener | None:
    """The opt-in TCP listener of ``AZQ_API_ADDR`` (bearer token; TLS with a certificate)."""
    env = env if env is not None else dict(os.environ)
    value = env.get(ENV_API_ADDR, "").strip()
    if not value:
        return None
    try:
        host, port = metrics.parse_addr(value)
    except ConfigError:
        raise ConfigError(f"{ENV_API_ADDR}={value!r}: expected HOST:PORT (e.g. 127.0.0.1:8470)") from None
    token = read_token(Path(env.get(ENV_TOKEN_FILE) or cfg.state_dir / "api-token"))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{ENV_API_ADDR}: cannot listen on {value}: {exc.strerror or exc}") from exc
    sock.listen(128)
    sock.setblocking(False)
    cert = env.get(ENV_CERT, "").strip()
    tls = {"ssl_certfile": cert, "ssl_keyfile": env.get(ENV_KEY, "").strip() or None} if cert else {}
    config = _config(Guard(app, limiter=limiter, token=token), **tls)
    bound = sock.getsockname()
    return Listener(sock, config, f"{'https' if cert else 'http'}://{value.rpartition(':')[0]}:{bound[1]}")


async def _run(listeners: list[Listener]) -> None:
    from anyio import to_thread

    to_thread.current_default_thread_limiter().total_tokens = THREADS
    servers = [_Server(lst.config) for lst in listeners]
    loop = asyncio.get_running_loop()

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(s.serve(sockets=[lst.sock]) for s, lst in zip(servers, listeners)))


def serve(socket_path: Path | None = None) -> None:
    """Run the daemon in the foreground until SIGTERM/SIGINT."""
    cfg = config_mod.load()
    config_mod.fault_spin_us()        # a bad value fails here, not at the first fault thread
    path = socket_path or cfg.daemon_socket
    check_free(path)
    # Fault handler threads serve vCPUs that wait: let them take the GIL from a busy
    # thread (compression, a client request) within a millisecond, not CPython's 5 ms.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    # Every thread started from here inherits this value (host/threads.py, MANAGER_NICE).
    threads.set_thread_nice(threads.MANAGER_NICE)
    metrics_listener = None
    reaper: TtlReaper | None = None
    unix_sock: socket.socket | None = None
    manager = Manager(cfg)
    try:
        metrics_listener = metrics.listen_from_env(manager)  # AZQ_METRICS_ADDR, off by default
        tags = SandboxTags(manager.registry, legacy_path=cfg.state_dir / "api-tags.json")
        app = make_app(manager, tags=tags)
        reaper = TtlReaper(tags, manager)
        limiter = Limiter()
        unix_sock = bind_unix(path)
        listeners = [Listener(unix_sock, _config(Guard(app, limiter=limiter)), f"unix:{path}")]
        tcp = tcp_listener(app, limiter, cfg)
        if tcp is not None:
            listeners.append(tcp)
        manager.start()
        reaper.start()
        for lst in listeners:
            log.info("azqemu daemon %d serving /v1 on %s", os.getpid(), lst.where)
        asyncio.run(_run(listeners))
    finally:
        if reaper is not None:
            reaper.stop()
        if unix_sock is not None:
            unix_sock.close()
            path.unlink(missing_ok=True)
        if metrics_listener is not None:
            metrics_listener.close()
        manager.close()
        log.info("azqemu daemon stopped")
