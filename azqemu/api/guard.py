"""The door of the API, before any route: bearer token, request cap, body size.

An ASGI middleware (not Starlette's BaseHTTPMiddleware, which buffers streams):
- ``token``: the TCP listener's (``AZQ_API_ADDR``) requests must carry
  ``Authorization: Bearer <token>``; the unix socket needs none (its peers are checked to be
  root by their credentials, ``daemon/server.py``). A missing or wrong token is
  ``Unauthorized`` (401), compared in constant time.
- ``limiter``: at most ``MAX_REQUESTS`` requests in progress over every listener (each
  operation holds a thread); one more is ``DaemonBusy`` (503) at once, not queued.
- body size: a request above its route's limit is ``PayloadTooLarge`` (413), from its
  Content-Length before anything is read, or while a chunked body streams in.
"""

from __future__ import annotations

import hmac
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from azqemu.api.app import error_response
from azqemu.daemon.files import MAX_FILE_BYTES
from azqemu.errors import DaemonBusy, PayloadTooLarge, Unauthorized

MAX_REQUESTS = 64
# A JSON request: an argv of up to 1 MiB (daemon/requests.py) with JSON's escapes.
MAX_BODY_BYTES = 8 << 20
# exec with its standard input (base64 in JSON): the old protocol's line limit. A file upload
# (PUT .../files, raw bytes) has the guest agent's limit, daemon.files.MAX_FILE_BYTES.
MAX_EXEC_BODY_BYTES = 64 << 20


def body_limit(path: str) -> int:
    if path.endswith("/files"):
        return MAX_FILE_BYTES
    return MAX_EXEC_BODY_BYTES if path.endswith("/exec") else MAX_BODY_BYTES


class Limiter:
    """Requests in progress, shared by the listeners (the event loop is single-threaded)."""

    def __init__(self, limit: int = MAX_REQUESTS) -> None:
        self.limit = limit
        self.in_flight = 0


class Guard:
    def __init__(self, app: ASGIApp, *, limiter: Limiter, token: str | None = None) -> None:
        self.app = app
        self.limiter = limiter
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if self.token is not None and not self._authorized(headers.get("authorization", "")):
            await error_response(Unauthorized("missing or wrong bearer token"))(scope, receive, send)
            return
        limit = body_limit(scope.get("path", ""))
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await error_response(PayloadTooLarge("the request body", limit))(scope, receive, send)
            return
        if self.limiter.in_flight >= self.limiter.limit:
            await error_response(DaemonBusy(self.limiter.limit))(scope, receive, send)
            return
        self.limiter.in_flight += 1
        try:
            await self.app(scope, _counting(receive, limit), send)
        finally:
            self.limiter.in_flight -= 1

    def _authorized(self, header: str) -> bool:
        scheme, _, given = header.partition(" ")
        assert self.token is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())


def _counting(receive: Receive, limit: int) -> Receive:
    seen = [0]

    async def wrapped() -> Message:
        msg: dict[str, Any] = dict(await receive())
        if msg.get("type") == "http.request":
            seen[0] += len(msg.get("body", b""))
            if seen[0] > limit:
                raise PayloadTooLarge("the request body", limit)
        return msg

    return wrapped
