"""Errors across the API (azqemu.api.errors): the same class, message, exit code and fields
on the client's side, the HTTP status of each kind, and RemoteError only for what the client
cannot rebuild."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import azqemu
from azqemu import errors as E
from azqemu.api.errors import error_info, rebuild, status_of
from azqemu.api.models import ErrorInfo
from azqemu.daemon.memstats import CompressCancelled
from azqemu.memory.persist import StoreFull


@pytest.mark.parametrize("exc, status", [
    (E.SandboxNotFound("a-0"), 404),
    (E.TemplateNotFound("base"), 404),
    (E.ConfigError("bad"), 400),
    (E.MalformedRequest("not JSON"), 400),
    (E.RequestInvalid("body.count: int", errors=[{"loc": "body.count", "msg": "int"}]), 422),
    (E.PayloadTooLarge("the body", 8), 413),
    (E.SandboxExists("a-0"), 409),
    (E.TemplateInUse("base", ["a-0"]), 409),
    (E.DomainStateError("a-0", "paused", "running"), 409),
    (E.DiskFull("/var/lib/azqemu", 1 << 30, 0), 507),
    (StoreFull("/dev/shm/azq", "arena 3"), 507),
    (E.DaemonBusy(64), 503),
    (E.Unauthorized("no token"), 401),
    (E.AgentTimeout("a-0", 1.0, "finish 'sleep'"), 504),
    (E.ExecError("cannot run", "GenericError"), 502),
    (E.ChecksumMismatch(7), 500),
])
def test_each_error_keeps_its_class_message_exit_code_and_fields(exc: E.AzqemuError, status: int) -> None:
    assert status_of(exc) == status
    info = ErrorInfo.model_validate_json(error_info(exc).model_dump_json())
    back = rebuild(info)
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert back.exit_code == exc.exit_code
    assert {k: v for k, v in vars(back).items() if k != "exit_code"} == \
        {k: v for k, v in vars(exc).items() if k != "exit_code"}


def test_fields_are_data_not_repr() -> None:
    info = error_info(E.TemplateInUse("base", ["b-1", "b-0"]))
    assert info.fields == {"name": "base", "clones": ["b-1", "b-0"]}
    assert info.type == "TemplateInUse" and info.module == "azqemu.errors" and info.exit_code == 1


def test_an_unexpected_exception_is_an_internal_error_of_one_line() -> None:
    info = error_info(KeyError("line one\nline two"))
    assert (info.type, info.exit_code, info.module) == ("InternalError", 70, "")
    assert "\n" not in info.message
    back = rebuild(info)
    assert isinstance(back, E.RemoteError)
    assert (back.error_type, back.exit_code) == ("InternalError", 70)


@pytest.mark.parametrize("type_, module", [("NoSuchError", "azqemu.errors"), ("Path", "pathlib"),
                                           ("system", "os")])
def test_a_type_this_side_does_not_know_is_a_remote_error(type_: str, module: str) -> None:
    back = rebuild(ErrorInfo(type=type_, message="m", exit_code=3, module=module))
    assert isinstance(back, E.RemoteError) and back.error_type == type_ and back.exit_code == 3


def test_a_changed_exit_code_travels() -> None:
    exc = E.SandboxNotFound("x")
    exc.exit_code = 125
    assert rebuild(error_info(exc)).exit_code == 125


def _error_classes() -> list[type[E.AzqemuError]]:
    """Every AzqemuError subclass defined in the package (C extensions and __main__ skipped)."""
    found = []
    for info in pkgutil.walk_packages(azqemu.__path__, "azqemu."):
        leaf = info.name.rsplit(".", 1)[-1]
        if leaf == "__main__" or (leaf.startswith("_") and not info.ispkg):
            continue
        for obj in vars(importlib.import_module(info.name)).values():
            if isinstance(obj, type) and issubclass(obj, E.AzqemuError) and obj.__module__ == info.name:
                found.append(obj)
    return found


def test_the_client_rebuilds_every_error_the_package_defines() -> None:
    """A class whose module the client does not look in comes back as a RemoteError: the fuzz
    test's compress loop met CompressCancelled so after it moved to daemon.memstats."""
    classes = _error_classes()
    assert CompressCancelled in classes and len(classes) > 40
    for cls in classes:
        info = ErrorInfo(type=cls.__name__, message="m", exit_code=1, module=cls.__module__)
        assert type(rebuild(info)) is cls, cls
    back = rebuild(error_info(CompressCancelled("fz-0", 3)))
    assert isinstance(back, CompressCancelled) and back.done == 3
