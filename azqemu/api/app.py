"""The ``/v1`` routes: one per manager operation, typed, documented at ``/v1/openapi.json``.

Every route is a thin call of the manager's ``op_*`` method (``azqemu.daemon.manager``, the
backend): the request model gives the JSON types, ``azqemu.daemon.requests.check_args`` the
values (names, ranges, finite numbers), the same checks as before any service runs. Routes are
plain functions, so FastAPI runs them in its thread pool: an operation may take seconds (a
compression) and the event loop stays free for other requests and streams. The cheap reads
are the exception: they run in a small pool of their own (``READ_THREADS``), so that many
clients polling the daemon queue in the event loop instead of in threads.

Errors: an ``AzqemuError`` becomes its JSON body and status (``azqemu.api.errors``); a request
that is not JSON is ``MalformedRequest`` (400), one of the wrong shape ``RequestInvalid``
(422), an unknown route ``ApiNotFound`` (404); anything unexpected ``InternalError`` (500,
exit code 70) with its traceback in the daemon's log.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Annotated, Any

import anyio
from anyio import to_thread
from fastapi import Body, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from azqemu import __version__
from azqemu.api import PREFIX, models, streams
from azqemu.api.errors import error_info, status_of
from azqemu.api.jobs import MAX_WAIT_S, Jobs
from azqemu.daemon import files
from azqemu.daemon import requests as checks
from azqemu.daemon.tags import SandboxTags, check_labels, check_ttl, matches, parse_selector
from azqemu.errors import (
    ApiNotFound,
    AzqemuError,
    ConfigError,
    MalformedRequest,
    RequestInvalid,
)
from azqemu.names import validate_name

log = logging.getLogger(__name__)

ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": models.ErrorBody, "description": d} for s, d in (
        (400, "Bad input (ConfigError: a name, a range), or a body that is not JSON (MalformedRequest)"),
        (404, "Unknown sandbox, template or job"),
        (409, "Conflict: the name is taken, the template has clones, the domain is in the wrong state"),
        (413, "Request body above its limit (PayloadTooLarge)"),
        (422, "Request of the wrong shape (RequestInvalid)"),
        (503, "Daemon busy (DaemonBusy) or libvirtd unavailable"),
        (507, "No room for the state directory or the page store (DiskFull, StoreFull)"))}
SANDBOX = "sandboxes"
MAX_EVENT_KINDS = 32
TEMPLATE = "templates"
DAEMON = "daemon"
# Threads for the cheap reads (ping, lists, dominfo, domstats, owned, memstats). Each is a few
# milliseconds of Python: more threads than cores do not make more of them, they only take the
# GIL from each other and from the event loop (with every read in the shared pool, azq bench
# api went from 170 requests/s at 8 clients to 6 at 100, the loop starved). Operations that
# wait (exec, compress, clone, files) keep the shared pool.
READ_THREADS = 4


def error_response(exc: BaseException) -> JSONResponse:
    status = status_of(exc) if isinstance(exc, AzqemuError) else 500
    return JSONResponse(models.ErrorBody(error=error_info(exc)).model_dump(mode="json"), status_code=status)


def _validation_error(errs: list[Any]) -> AzqemuError:
    if any(e.get("type") == "json_invalid" for e in errs):
        detail = next((str(e.get("ctx", {}).get("error", "")) for e in errs), "")
        return MalformedRequest(f"the request body is not JSON: {detail}".rstrip(": "))
    shown = [{"loc": ".".join(str(p) for p in e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in errs[:8]]
    first = shown[0] if shown else {"loc": "", "msg": "invalid request"}
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return RequestInvalid(f"{first['loc']}: {first['msg']}{more}", errors=shown)


def make_app(manager: Any, jobs: Jobs | None = None, tags: SandboxTags | None = None) -> FastAPI:
    """The API over ``manager`` (an ``azqemu.daemon.manager.Manager``); labels and TTLs through
    ``tags`` (kept in the sandbox records)."""
    jobs = jobs or Jobs()
    tags = tags or SandboxTags(manager.registry)
    app = FastAPI(title="azqemu", version=__version__, openapi_url=f"{PREFIX}/openapi.json",
                  docs_url=f"{PREFIX}/docs", redoc_url=None,
                  description="Dense AI-agent sandbox VMs through guest-memory compression. "
                              "Errors: {\"error\": {type, message, exit_code, fields, module}}. See docs/api.md.")
    app.router.redirect_slashes = False   # /v1/sandboxes/ (an empty name) is not /v1/sandboxes
    app.state.manager = manager
    app.state.jobs = jobs
    app.state.tags = tags
    if hasattr(manager, "labels_of"):   # labels go into the domains' <metadata> too (the
        manager.labels_of = lambda name: tags.get(name)["labels"]   # record's change asks for it)

    @app.exception_handler(AzqemuError)
    async def _azq(_req: Request, exc: AzqemuError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(_validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc.__cause__, AzqemuError):  # raised while FastAPI read the body (guard)
            return error_response(exc.__cause__)
        if isinstance(exc.__cause__, RecursionError):
            return error_response(MalformedRequest("the request body is nested too deeply"))
        if isinstance(exc.__cause__, ValueError):  # not UTF-8, and the like
            return error_response(MalformedRequest(f"the request body is not JSON: {exc.__cause__}"))
        if exc.status_code == 404:
            return error_response(ApiNotFound(f"no API route {req.url.path[:200]}", path=req.url.path[:200]))
        if exc.status_code == 405:
            return error_response(ApiNotFound(f"{req.method} is not allowed on {req.url.path[:200]}",
                                              path=req.url.path[:200]))
        return error_response(ConfigError(f"bad request: {exc.detail}"))

    @app.exception_handler(Exception)
    async def _internal(req: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s crashed", req.method, req.url.path)
        return error_response(exc)

    def call(op: str, **kw: Any) -> Any:
        """Check the arguments, then run the manager's operation."""
        checks.check_args(op, kw)
        fn: Callable[..., Any] = getattr(manager, f"op_{op}")
        return fn(**kw)

    read_pool: list[anyio.CapacityLimiter] = []   # made in the event loop, at the first read

    async def read(op: str, **kw: Any) -> Any:
        """``call`` for a cheap read, in a pool of its own of READ_THREADS threads: a read waits
        for one in the event loop, not in a thread of the shared pool that fights for the GIL."""
        if not read_pool:
            read_pool.append(anyio.CapacityLimiter(READ_THREADS))
        return await to_thread.run_sync(functools.partial(call, op, **kw), limiter=read_pool[0])

    # -- the daemon ------------------------------------------------------------------------
    @app.get(f"{PREFIX}/ping", response_model=models.Ping, tags=[DAEMON], responses=ERRORS)
    async def ping() -> dict[str, Any]:
        """The daemon answers: its pid, start time, number of sandboxes, version."""
        return dict(await read("ping"), version=__version__, api=PREFIX.strip("/"))

    @app.get(f"{PREFIX}/jobs", response_model=list[models.Job], tags=[DAEMON])
    def list_jobs() -> list[models.Job]:
        """Jobs running and recently finished."""
        return jobs.list()

    @app.get(f"{PREFIX}/jobs/{{job_id}}", response_model=models.Job, tags=[DAEMON], responses=ERRORS)
    def get_job(job_id: str, wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False,
                                                          description="Seconds to wait for it to finish")] = 0.0
                ) -> models.Job:
        """A job: running, succeeded (with its result) or failed (with its error)."""
        return jobs.get(job_id, wait)

    @app.get(f"{PREFIX}/events", response_model=list[models.Event], response_model_exclude_none=True,
             tags=[DAEMON], responses=ERRORS)
    def events(since: Annotated[float, Query(ge=0, allow_inf_nan=False, description="Unix time")] = 0.0,
               follow: Annotated[bool, Query(description="Stream: one JSON event per line "
                                                         "(application/x-ndjson) until the client leaves")] = False,
               sandbox: Annotated[str | None, Query(description="Only this sandbox's events")] = None,
               event: Annotated[list[str] | None, Query(description="Only events of this kind (repeatable: "
                                                                    "created, phase, compress, resume, ...)")] = None,
               ) -> Any:
        """Recent sandbox events (libvirt's lifecycle events and azqemu's own), or (``follow``)
        a stream of them."""
        if sandbox is not None:
            validate_name(sandbox, "sandbox name")
        if event is not None and (len(event) > MAX_EVENT_KINDS or any(len(k) > 64 for k in event)):
            raise ConfigError(f"event: at most {MAX_EVENT_KINDS} kinds of at most 64 characters")
        if follow:
            checks.check_args("events", {"since": since})
            return streams.events_response(manager.events, since, sandbox=sandbox, kinds=event)
        return call("events", since=since, sandbox=sandbox, event=event)

    @app.get(f"{PREFIX}/owned", response_model=models.Owned, tags=[DAEMON], responses=ERRORS)
    async def owned(names: Annotated[str | None, Query(description="Comma-separated sandbox names "
                                                                   "(absent: all; empty: none)")] = None) -> Any:
        """Owned, resident and stored bytes per sandbox, the store's and the manager's memory."""
        listed = None if names is None else [n for n in names.split(",") if n]
        return await read("owned", names=listed)

    @app.post(f"{PREFIX}/policy", status_code=204, tags=[SANDBOX], responses=ERRORS)
    def set_policy(req: models.PolicyRequest) -> Response:
        """A new memory policy (and grace period, pressure budget) for sandboxes."""
        call("set_policy", **req.model_dump())
        return Response(status_code=204)

    # -- templates -------------------------------------------------------------------------
    @app.get(f"{PREFIX}/templates", response_model=list[models.Template], tags=[TEMPLATE])
    async def list_templates() -> Any:
        return await read("template_list")

    @app.post(f"{PREFIX}/templates", status_code=202, response_model=models.Job, tags=[TEMPLATE],
              responses=ERRORS)
    def create_template(req: models.TemplateCreate,
                        wait: Annotated[float, Query(ge=0, le=MAX_WAIT_S, allow_inf_nan=False,
                                                     description="Seconds to wait for the job")] = 0.0
                        ) -> models.Job:
        """Build a template (minutes): a job; poll ``GET /v1/jobs/{id}`` or pass ``wait``."""
        kw = req.model_dump()
        checks.check_args("template_create", kw)
        job = jobs.start("template_create", lambda: call("template_create", **kw))
        return jobs.get(job.id, wait) if wait else job

    @app.delete(f"{PREFIX}/templates/{{name}}", status_code=204, tags=[TEMPLATE], responses=ERRORS)
    def delete_template(name: str) -> Response:
        """Delete a template (refused while it has clones)."""
        call("template_delete", name=name)
        return Response(status_code=204)

    # -- sandboxes -------------------------------------------------------------------------
    @app.get(f"{PREFIX}/sandboxes", response_model=list[models.SandboxInfo], tags=[SANDBOX], responses=ERRORS)
    async def list_sandboxes(state: Annotated[str | None, Query(max_length=64)] = None,
                             template: Annotated[str | None, Query(max_length=64)] = None,
                             sharing_domain: Annotated[str | None, Query(max_length=64)] = None,
                             label: Annotated[list[str] | None, Query(max_length=32, description=(
                                 "KEY=VALUE or KEY (repeatable): sandboxes with every one of these labels"))] = None,
                             ) -> Any:
        """Sandboxes with their state, template, memory and labels; filters match exactly."""
        selectors = [parse_selector(sel) for sel in label or []]
        rows = await read("list")   # each row is its record's, labels and expires_at included
        want = {"state": state, "template": template, "sharing_domain": sharing_domain}
        return [r for r in rows if all(v is None or r.get(k) == v for k, v in want.items())
                and matches(r, selectors)]

    @app.post(f"{PREFIX}/sandboxes", status_code=201, response_model=list[models.Sandbox], tags=[SANDBOX],
              responses=ERRORS)
    def clone(req: models.CloneRequest) -> Any:
        """Clone a template COUNT times (or once per name); all or nothing. Labels and a time to
        live (``ttl_s``) go on every clone."""
        kw = req.model_dump()
        labels, ttl_s = check_labels(kw.pop("labels")), check_ttl(kw.pop("ttl_s"))
        rows = call("clone", **kw)
        return [dict(r, **tags.assign(r["name"], labels, ttl_s)) if labels or ttl_s is not None else r
                for r in rows]

    @app.get(f"{PREFIX}/sandboxes/{{name}}", response_model=models.DomInfo, tags=[SANDBOX], responses=ERRORS)
    async def dominfo(name: str) -> Any:
        return await read("dominfo", name=name)

    @app.patch(f"{PREFIX}/sandboxes/{{name}}", response_model=models.DomInfo, tags=[SANDBOX], responses=ERRORS)
    def update(name: str, req: models.SandboxUpdate) -> Any:
        """Set labels (merged, or replaced) and a new time to live from now."""
        checks.check_args("dominfo", {"name": name})
        tags.assign(name, req.labels, req.ttl_s, replace=req.replace_labels)   # SandboxNotFound if unknown
        return call("dominfo", name=name)

    @app.delete(f"{PREFIX}/sandboxes/{{name}}", status_code=204, tags=[SANDBOX], responses=ERRORS)
    def destroy(name: str) -> Response:
        call("destroy", name=name)
        tags.forget(name)   # its record (labels, expiry) went with it
        return Response(status_code=204)

    @app.put(f"{PREFIX}/sandboxes/{{name}}/files", response_model=models.FileWritten, tags=[SANDBOX],
             responses=ERRORS, openapi_extra={"requestBody": {"required": True, "content": {
                 "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}})
    async def put_file(name: str, request: Request,
                       path: Annotated[str, Query(max_length=files.MAX_PATH_CHARS,
                                                  description="Absolute path in the guest")]) -> Any:
        """Write the body (raw bytes, at most 16 MiB) to PATH in the sandbox."""
        checks.check_args("file_put", {"name": name})
        files.check_path(path)
        data = await request.body()
        return await run_in_threadpool(files.put, manager, name, path, data)

    @app.get(f"{PREFIX}/sandboxes/{{name}}/files", response_class=Response, tags=[SANDBOX],
             responses={**ERRORS, 200: {"content": {"application/octet-stream": {
                 "schema": {"type": "string", "format": "binary"}}}, "description": "The file's bytes"}})
    def get_file(name: str, path: Annotated[str, Query(max_length=files.MAX_PATH_CHARS,
                                                       description="Absolute path in the guest")]) -> Response:
        """Read PATH from the sandbox (at most 16 MiB)."""
        checks.check_args("file_get", {"name": name})
        return Response(files.get(manager, name, path), media_type="application/octet-stream")

    @app.post(f"{PREFIX}/sandboxes/{{name}}/exec", response_model=models.ExecResult, tags=[SANDBOX],
              responses=ERRORS)
    def exec_(name: str, req: models.ExecRequest) -> Any:
        """Run a command through the guest agent (resuming a sandbox azqemu paused first).
        The command's own exit code is ``exit_code``; an error status means azqemu failed."""
        return call("exec", name=name, **req.model_dump())

    @app.post(f"{PREFIX}/sandboxes/{{name}}/exec/stream", tags=[SANDBOX], responses={
        **ERRORS, 200: {"content": {streams.NDJSON: {"schema": {"type": "string"}}}, "description": (
            "JSON lines: {event: started}, {event: stdout|stderr, data_b64} chunks as the command writes "
            "them, {event: running, elapsed_s} every 5 s without output, then {event: exit, exit_code, "
            "duration_s, ...} or {event: error, error}")}})
    def exec_stream(name: str, req: models.ExecRequest) -> Any:
        """``exec`` as a stream of JSON lines: the command's stdout and stderr while it runs
        (at most 16 MiB in all: past it the command is killed, the last line a PayloadTooLarge
        error), then its exit."""
        kw = dict(name=name, **req.model_dump())
        checks.check_args("exec", kw)
        manager.registry.record(name)   # SandboxNotFound as a 404, before the stream starts
        return streams.exec_response(lambda sink: manager.op_exec(**kw, on_output=sink),
                                     lambda exc: models.ErrorBody(error=error_info(exc)).model_dump(mode="json"))

    @app.post(f"{PREFIX}/sandboxes/{{name}}/phase", response_model=models.PhaseResult, tags=[SANDBOX],
              responses=ERRORS)
    def phase(name: str, req: models.PhaseRequest) -> Any:
        """The orchestrator's hint: 'wait' or 'tool' (a compressed sandbox is resumed ahead of it)."""
        return call("phase", name=name, phase=req.phase)

    @app.post(f"{PREFIX}/sandboxes/{{name}}/pause", status_code=204, tags=[SANDBOX], responses=ERRORS)
    def pause(name: str) -> Response:
        """The user's pause: azqemu leaves it paused (exec refuses it until resumed)."""
        call("pause", name=name)
        return Response(status_code=204)

    @app.post(f"{PREFIX}/sandboxes/{{name}}/resume", response_model=models.ResumeResult, tags=[SANDBOX],
              responses=ERRORS)
    def resume(name: str, req: Annotated[models.ResumeRequest | None, Body()] = None) -> Any:
        """Continue a sandbox; a compressed one gets its hot set back first."""
        return call("resume", name=name, prefetch=req.prefetch if req is not None else True)

    @app.post(f"{PREFIX}/sandboxes/{{name}}/compress", response_model=models.CompressResult, tags=[SANDBOX],
              responses=ERRORS)
    def compress(name: str) -> Any:
        """Pause the sandbox and compress its RAM into the page store (it stays paused)."""
        return call("compress", name=name)

    @app.post(f"{PREFIX}/sandboxes/{{name}}/trim", response_model=models.TrimResult | None, tags=[SANDBOX],
              responses=ERRORS)
    def trim(name: str) -> Any:
        """Drop the copies a running sandbox holds that equal their stored entries (null: nothing to trim)."""
        return call("trim", name=name)

    @app.get(f"{PREFIX}/sandboxes/{{name}}/domstats", response_model=models.DomStats, tags=[SANDBOX],
             responses=ERRORS)
    async def domstats(name: str) -> Any:
        """State, phase, owned/resident/stored bytes, fault and compress/restore counters."""
        return await read("domstats", name=name)

    @app.get(f"{PREFIX}/sandboxes/{{name}}/memstats", response_model=models.MemStats, tags=[SANDBOX],
             responses=ERRORS)
    async def memstats(name: str, reset: bool = False) -> Any:
        """Restore figures: fault counters, service times since the last reset, last compress and resume."""
        return await read("memstats", name=name, reset=reset)

    return app
