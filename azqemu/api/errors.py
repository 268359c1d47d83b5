"""Errors across the API: an ``AzqemuError`` as a JSON body with an HTTP status, and back.

The daemon answers a failed request with ``{"error": {"type", "message", "exit_code",
"fields", "module"}}`` and the status of the error's class (``STATUS``, by the class or its
nearest base). The client rebuilds the same class from ``type`` and ``module`` with its fields
set, without calling its constructor (whose arguments are not always its fields), so
``except SandboxNotFound`` works on both sides of the socket and the CLI exits with the same
code. A type the client cannot find (an unexpected exception in the daemon, a newer daemon)
comes back as ``RemoteError`` carrying the type's name and exit code.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

from azqemu import errors as E
from azqemu.api.models import ErrorInfo

# The HTTP status of an error class; a class not listed takes its nearest listed base's.
STATUS: dict[str, int] = {
    "ConfigError": 400,
    "MalformedRequest": 400,
    "RequestInvalid": 422,
    "PayloadTooLarge": 413,
    "Unauthorized": 401,
    "NotRoot": 403,
    "SandboxNotFound": 404,
    "TemplateNotFound": 404,
    "DomainNotFound": 404,
    "ApiNotFound": 404,
    "GuestFileNotFound": 404,
    "GuestFileError": 400,
    "SandboxExists": 409,
    "TemplateExists": 409,
    "TemplateInUse": 409,
    "DomainStateError": 409,
    "SandboxStateError": 409,
    "CompressCancelled": 409,
    "DiskFull": 507,
    "StoreFull": 507,
    "DaemonBusy": 503,
    "LibvirtUnavailable": 503,
    "AgentTimeout": 504,
    "AgentError": 502,
    "AzqemuError": 500,
}
INTERNAL_STATUS = 500
INTERNAL_EXIT_CODE = 70   # sysexits EX_SOFTWARE: a bug in the daemon, its traceback in the daemon's log
MAX_FIELD_CHARS = 4096    # a field is data for a program, not a dump of the daemon's state

# Modules whose error classes a client may be asked to rebuild (besides azqemu.errors).
# Every module that defines an AzqemuError (tests/unit/api/test_errors.py walks the package);
# daemon.sandboxmem stays for daemons from before CompressCancelled moved to daemon.memstats.
KNOWN_MODULES = ("azqemu.errors", "azqemu.restore.errors", "azqemu.memory.persist", "azqemu.memory.store",
                 "azqemu.daemon.memstats", "azqemu.daemon.sandboxmem", "azqemu.bench.restore_bench")


def status_of(exc: E.AzqemuError) -> int:
    for cls in type(exc).__mro__:
        if cls.__name__ in STATUS:
            return STATUS[cls.__name__]
    return INTERNAL_STATUS


def _fields(exc: BaseException) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in vars(exc).items():
        if k.startswith("_") or k in ("exit_code", "args"):
            continue
        try:
            text = json.dumps(v)
        except (TypeError, ValueError):
            continue
        if len(text) <= MAX_FIELD_CHARS:
            out[k] = v
    return out


def error_info(exc: BaseException) -> ErrorInfo:
    """The body of an error reply; anything but an AzqemuError is an internal error."""
    if isinstance(exc, E.AzqemuError):
        return ErrorInfo(type=type(exc).__name__, message=_one_line(str(exc)), exit_code=exc.exit_code,
                         fields=_fields(exc), module=type(exc).__module__)
    return ErrorInfo(type="InternalError", message=_one_line(f"internal error: {type(exc).__name__}: {exc}"),
                     exit_code=INTERNAL_EXIT_CODE, module="")


def _one_line(text: str) -> str:
    return " ".join(text.split()) if "\n" in text or "\r" in text else text


def _find_class(name: str, module: str) -> type[E.AzqemuError] | None:
    modules = ["azqemu.errors"] + ([module] if module in KNOWN_MODULES and module != "azqemu.errors" else [])
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        cls = getattr(mod, name, None)
        if isinstance(cls, type) and issubclass(cls, E.AzqemuError):
            return cls
    return None


def rebuild(info: ErrorInfo) -> E.AzqemuError:
    """The client's copy of an error the daemon raised: the same class and fields if this side
    knows it, else a RemoteError."""
    cls = _find_class(info.type, info.module)
    if cls is None or cls is E.RemoteError:
        return E.RemoteError(info.type, info.message, info.exit_code)
    exc = cls.__new__(cls)
    Exception.__init__(exc, info.message)
    for k, v in info.fields.items():
        setattr(exc, k, v)
    if exc.exit_code != info.exit_code:
        exc.exit_code = info.exit_code
    return exc
