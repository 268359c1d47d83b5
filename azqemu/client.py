"""The typed Python client of the daemon's ``/v1`` API (what the CLI itself uses).

    from azqemu.client import Client
    with Client() as c:
        (sbx,) = c.clone("base", count=1)
        r = c.exec(sbx.name, ["uname", "-r"])
        print(r.exit_code, r.stdout)

By default it talks to the root-only unix socket (``AZQ_RUN_DIR``/azqemu.sock); with
``url`` (or ``AZQ_API_URL``) to the daemon's TCP listener with a bearer token (``token``,
``AZQ_API_TOKEN``, or the file ``AZQ_API_TOKEN_FILE``). Every method returns the API's
models (``azqemu.api.models``) and raises what the daemon raised, rebuilt with its class and
fields (``azqemu.api.errors``): ``SandboxNotFound``, ``TemplateInUse``, ``ConfigError`` ...;
``DaemonUnavailable`` when nothing listens. Names are checked here first, so a bad one is the
same ``ConfigError`` (exit code 2) without a round trip.
"""

from __future__ import annotations

import base64
import json
import os
import re
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from azqemu import config as config_mod
from azqemu.api import PREFIX
from azqemu.api import models as m
from azqemu.api.errors import rebuild
from azqemu.errors import AzqemuError, DaemonBusy, DaemonError, DaemonUnavailable, RemoteError
from azqemu.names import validate_name

CONNECT_TIMEOUT_S = 5.0
# A pooled connection idle this long is not reused: well under the daemon's keep-alive
# (daemon/server.py, KEEP_ALIVE_S = 5 s), so a request never goes out on a connection the
# daemon is closing at that moment (seen as "Connection reset by peer" in a density run when
# a tool call came ~5 s after the previous request, httpx's default expiry being 5 s too).
KEEPALIVE_S = 2.0
# How long one poll of a job waits in the daemon (the client polls again until it is done).
JOB_POLL_S = 60.0
ENV_URL = "AZQ_API_URL"
ENV_TOKEN = "AZQ_API_TOKEN"
ENV_TOKEN_FILE = "AZQ_API_TOKEN_FILE"


def _token_from_env() -> str | None:
    if os.environ.get(ENV_TOKEN):
        return os.environ[ENV_TOKEN].strip()
    path = os.environ.get(ENV_TOKEN_FILE)
    return Path(path).read_text().strip() if path else None


@dataclass(frozen=True)
class Endpoint:
    """Where a client connects: a unix socket (``uds``) or a URL, with the headers (token)."""
    where: str                  # what errors name: the socket path or the URL
    base_url: str               # up to, without, the /v1 prefix
    uds: str | None
    headers: dict[str, str]


def endpoint(socket_path: Path | str | None = None, url: str | None = None,
             token: str | None = None) -> Endpoint:
    """The daemon a client talks to: ``url`` (or ``AZQ_API_URL``) with a bearer token
    (``token``, ``AZQ_API_TOKEN``, ``AZQ_API_TOKEN_FILE``), else the unix socket."""
    url = url or (os.environ.get(ENV_URL) if socket_path is None else None)
    headers = {"accept": "application/json"}
    if url:
        token = token if token is not None else _token_from_env()
        if token:
            headers["authorization"] = f"Bearer {token}"
        return Endpoint(url, url.rstrip("/"), None, headers)
    path = Path(socket_path) if socket_path else config_mod.load().daemon_socket
    return Endpoint(str(path), "http://azqemu", str(path), headers)


class Client:
    def __init__(self, socket_path: Path | str | None = None, *, url: str | None = None,
                 token: str | None = None, timeout_s: float | None = None,
                 verify: bool | str | ssl.SSLContext = True) -> None:
        ep = endpoint(socket_path, url, token)
        self.where = ep.where
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)   # given to the transport: the client's own is not used then
        if ep.uds is None:
            if isinstance(verify, str):   # a CA bundle (the daemon's own certificate)
                verify = ssl.create_default_context(cafile=verify)
            transport = httpx.HTTPTransport(verify=verify, limits=limits)
        else:
            transport = httpx.HTTPTransport(uds=ep.uds, limits=limits)
        self._http = httpx.Client(transport=transport, base_url=ep.base_url + PREFIX, headers=ep.headers,
                                  timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    # -- the wire -------------------------------------------------------------------------
    def _request(self, method: str, path: str, *, body: Any = None, params: dict[str, Any] | None = None,
                 timeout_s: float | None = None, content: bytes | None = None, raw: bool = False) -> Any:
        kw: dict[str, Any] = {}
        if body is not None:
            kw["json"] = body
        if content is not None:
            kw["content"] = content
            kw["headers"] = {"content-type": "application/octet-stream"}
        if timeout_s is not None:
            kw["timeout"] = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
        try:
            r = self._http.request(method, path, params=_params(params), **kw)
        except httpx.ConnectError as exc:
            raise DaemonUnavailable(self.where, _why(exc)) from exc
        except httpx.TimeoutException as exc:
            raise DaemonError(f"the daemon at {self.where} did not answer {method} {path} in time") from exc
        except httpx.TransportError as exc:
            raise DaemonError(f"the connection to the daemon at {self.where} failed: {_why(exc)}") from exc
        if r.status_code >= 400:
            raise _error(r)
        if raw:
            return r.content
        if r.status_code == 204 or not r.content:
            return None
        return r.json()

    # -- the daemon -----------------------------------------------------------------------
    def ping(self) -> m.Ping:
        return m.Ping.model_validate(self._request("GET", "/ping"))

    def job(self, job_id: str, wait_s: float = 0.0) -> m.Job:
        return m.Job.model_validate(self._request("GET", f"/jobs/{quote(job_id, safe='')}",
                                                  params={"wait": wait_s} if wait_s else None))

    def wait_job(self, job_id: str, timeout_s: float | None = None) -> Any:
        """The job's result once it is done; its error (rebuilt) if it failed."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = JOB_POLL_S if deadline is None else max(0.0, min(JOB_POLL_S, deadline - time.monotonic()))
            job = self.job(job_id, wait_s=left)
            if job.state == "succeeded":
                return job.result
            if job.state == "failed":
                raise rebuild(job.error) if job.error else DaemonError(f"job {job_id} failed")
            if deadline is not None and time.monotonic() >= deadline:
                raise DaemonError(f"job {job_id} ({job.kind}) still running after {timeout_s:g} s")

    def events(self, since: float = 0.0, *, sandbox: str | None = None,
               event: list[str] | None = None) -> list[m.Event]:
        """Recent events, oldest first; only ``sandbox``'s and of the kinds in ``event`` if given."""
        params = {"since": since, "sandbox": sandbox, "event": event or None}
        return [m.Event.model_validate(e) for e in self._request("GET", "/events", params=params)]

    def follow_events(self, since: float = 0.0, *, sandbox: str | None = None,
                      event: list[str] | None = None) -> Iterator[m.Event]:
        """The daemon's events as they happen (a stream; ends when the daemon stops)."""
        params = _params({"since": since, "follow": "true", "sandbox": sandbox, "event": event or None})
        try:
            with self._http.stream("GET", "/events", params=params,
                                   timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error(r)
                for line in r.iter_lines():
                    if line.strip():
                        yield m.Event.model_validate_json(line)
        except httpx.ConnectError as exc:
            raise DaemonUnavailable(self.where, _why(exc)) from exc
        except httpx.TransportError as exc:
            raise DaemonError(f"the event stream from {self.where} broke: {_why(exc)}") from exc

    def owned(self, names: list[str] | None = None) -> m.Owned:
        for n in names or []:
            validate_name(n, "sandbox name")
        params = None if names is None else {"names": ",".join(names)}
        return m.Owned.model_validate(self._request("GET", "/owned", params=params))

    def set_policy(self, names: list[str], policy: str, grace_s: float | None = None,
                   pressure_budget_bytes: int | None = None) -> None:
        self._request("POST", "/policy", body=m.PolicyRequest(
            names=names, policy=policy, grace_s=grace_s,
            pressure_budget_bytes=pressure_budget_bytes).model_dump(exclude_none=True))

    # -- templates ------------------------------------------------------------------------
    def template_list(self) -> list[m.Template]:
        return [m.Template.model_validate(t) for t in self._request("GET", "/templates")]

    def template_create_job(self, name: str, mem_mib: int = 512, vcpus: int = 1,
                            warmup: list[str] | None = None) -> m.Job:
        validate_name(name, "template name")
        body = m.TemplateCreate(name=name, mem_mib=mem_mib, vcpus=vcpus, warmup=list(warmup or ()))
        return m.Job.model_validate(self._request("POST", "/templates", body=body.model_dump()))

    def template_create(self, name: str, mem_mib: int = 512, vcpus: int = 1,
                        warmup: list[str] | None = None) -> m.Template:
        """Build a template and wait for the job."""
        job = self.template_create_job(name, mem_mib=mem_mib, vcpus=vcpus, warmup=warmup)
        return m.Template.model_validate(self.wait_job(job.id))

    def template_delete(self, name: str) -> None:
        self._request("DELETE", f"/templates/{_name(name, 'template name')}")

    # -- sandboxes ------------------------------------------------------------------------
    def list_sandboxes(self, *, state: str | None = None, template: str | None = None,
                       sharing_domain: str | None = None, label: list[str] | None = None) -> list[m.SandboxInfo]:
        """Sandboxes; ``label``: KEY=VALUE or KEY selectors that must all match."""
        params = {"state": state, "template": template, "sharing_domain": sharing_domain, "label": label}
        return [m.SandboxInfo.model_validate(r) for r in self._request("GET", "/sandboxes", params=params)]

    def clone(self, template: str, count: int = 1, name_prefix: str | None = None,
              sharing_domain: str = "default", names: list[str] | None = None,
              ram_mode: str | None = None, policy: str = "manual",
              grace_s: float = m.DEFAULT_GRACE_S, labels: dict[str, str] | None = None,
              ttl_s: float | None = None) -> list[m.Sandbox]:
        validate_name(template, "template name")
        body = {"template": template, "count": count, "name_prefix": name_prefix,
                "sharing_domain": sharing_domain, "names": names, "ram_mode": ram_mode, "policy": policy,
                "grace_s": grace_s, "labels": labels or {}, "ttl_s": ttl_s}
        return [m.Sandbox.model_validate(r) for r in self._request("POST", "/sandboxes", body=body)]

    def dominfo(self, name: str) -> m.DomInfo:
        return m.DomInfo.model_validate(self._request("GET", f"/sandboxes/{_name(name)}"))

    def destroy(self, name: str) -> None:
        self._request("DELETE", f"/sandboxes/{_name(name)}")

    def update(self, name: str, *, labels: dict[str, str] | None = None, ttl_s: float | None = None,
               replace_labels: bool = False) -> m.DomInfo:
        """Set labels (merged unless ``replace_labels``; an empty value removes one) and a TTL."""
        body = {"labels": labels, "ttl_s": ttl_s, "replace_labels": replace_labels}
        return m.DomInfo.model_validate(self._request("PATCH", f"/sandboxes/{_name(name)}", body=body))

    def put_file(self, name: str, path: str, data: bytes) -> m.FileWritten:
        """Write ``data`` to ``path`` in the sandbox (at most 16 MiB: PayloadTooLarge above)."""
        return m.FileWritten.model_validate(self._request(
            "PUT", f"/sandboxes/{_name(name)}/files", params={"path": path}, content=data))

    def get_file(self, name: str, path: str) -> bytes:
        return self._request("GET", f"/sandboxes/{_name(name)}/files", params={"path": path}, raw=True)

    def exec(self, name: str, argv: list[str], timeout_s: float = m.DEFAULT_EXEC_TIMEOUT_S,
             stdin: bytes | None = None, kind: str | None = None) -> m.ExecResult:
        """Run ``argv`` in the guest; the command's own failure is ``exit_code``, azqemu's raises.
        ``kind``: the tool's name (ExecRequest.kind)."""
        body = _exec_body(argv, timeout_s, stdin, kind)
        return m.ExecResult.model_validate(self._request("POST", f"/sandboxes/{_name(name)}/exec", body=body))

    def exec_stream(self, name: str, argv: list[str], timeout_s: float = m.DEFAULT_EXEC_TIMEOUT_S,
                    stdin: bytes | None = None, kind: str | None = None) -> Iterator[dict[str, Any]]:
        """``exec`` as events, as they happen: started, stdout/stderr chunks (``data`` as bytes)
        while the command writes them, running (liveness, every 5 s without output), and last
        exit (exit_code, duration_s, ...). An azqemu failure is raised (past 16 MiB of output:
        PayloadTooLarge, the command killed); so is a stream that ends without its exit."""
        body = _exec_body(argv, timeout_s, stdin, kind)
        try:
            with self._http.stream("POST", f"/sandboxes/{_name(name)}/exec/stream", json=body,
                                   timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S)) as r:
                if r.status_code >= 400:
                    r.read()
                    raise _error(r)
                for line in r.iter_lines():
                    if not line.strip():
                        continue
                    ev = json.loads(line)
                    if ev.get("event") == "error":
                        raise rebuild(m.ErrorBody.model_validate(ev).error)
                    if "data_b64" in ev:
                        ev["data"] = base64.b64decode(ev.pop("data_b64"))
                    yield ev
                    if ev.get("event") == "exit":
                        return
        except httpx.ConnectError as exc:
            raise DaemonUnavailable(self.where, _why(exc)) from exc
        except httpx.TransportError as exc:
            raise DaemonError(f"the exec stream from {self.where} broke: {_why(exc)}") from exc
        raise DaemonError(f"the exec stream from {self.where} ended before the command's exit")

    def phase(self, name: str, phase: str) -> m.PhaseResult:
        return m.PhaseResult.model_validate(self._request("POST", f"/sandboxes/{_name(name)}/phase",
                                                          body={"phase": phase}))

    def pause(self, name: str) -> None:
        self._request("POST", f"/sandboxes/{_name(name)}/pause")

    def resume(self, name: str, prefetch: bool = True) -> m.ResumeResult:
        return m.ResumeResult.model_validate(self._request("POST", f"/sandboxes/{_name(name)}/resume",
                                                           body={"prefetch": prefetch}))

    def compress(self, name: str) -> m.CompressResult:
        return m.CompressResult.model_validate(self._request("POST", f"/sandboxes/{_name(name)}/compress"))

    def trim(self, name: str) -> m.TrimResult | None:
        r = self._request("POST", f"/sandboxes/{_name(name)}/trim")
        return None if r is None else m.TrimResult.model_validate(r)

    def domstats(self, name: str) -> m.DomStats:
        return m.DomStats.model_validate(self._request("GET", f"/sandboxes/{_name(name)}/domstats"))

    def memstats(self, name: str, reset: bool = False) -> m.MemStats:
        return m.MemStats.model_validate(self._request("GET", f"/sandboxes/{_name(name)}/memstats",
                                                       params={"reset": "true" if reset else None}))


def _name(name: str, what: str = "sandbox name") -> str:
    return quote(validate_name(name, what), safe="")


def _exec_body(argv: list[str], timeout_s: float, stdin: bytes | None, kind: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"argv": list(argv), "timeout_s": timeout_s}
    if stdin is not None:
        body["stdin_b64"] = base64.b64encode(stdin).decode()
    if kind is not None:
        body["kind"] = kind
    return body


def _params(params: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if params is None else {k: v for k, v in params.items() if v is not None}


def _why(exc: BaseException) -> str:
    """The OS's reason under httpx's and httpcore's wrappers ("No such file or directory")."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            break
        if isinstance(seen, OSError) and seen.strerror:
            return seen.strerror
        seen = seen.__cause__ or seen.__context__
    return re.sub(r"^\[Errno \d+\] ", "", str(exc)) or type(exc).__name__


def _error(r: httpx.Response) -> AzqemuError:
    """The daemon's error reply as the error it raised."""
    try:
        return rebuild(m.ErrorBody.model_validate(json.loads(r.content)).error)
    except (ValueError, ValidationError):
        pass
    if r.status_code == 503:   # uvicorn's own connection cap answers in plain text
        return DaemonBusy(0)
    return RemoteError("HTTPError", f"HTTP {r.status_code} from the daemon: {r.text[:200].strip()}", 1)
