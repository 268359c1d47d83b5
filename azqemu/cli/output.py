"""Output of the CLI: ``--json`` on every command, and errors as JSON under it.

A command's ``--json`` option (``json_option``) records that the caller reads JSON; the
command prints its result with ``emit`` and, if it fails, ``azqemu.cli.main`` prints the error
as ``{"error": {"type", "message", "exit_code", "fields", "module"}}`` on stdout (the API's
error body) instead of the one line on stderr. The exit code is the same either way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import click
from pydantic import BaseModel

F = TypeVar("F", bound=Callable[..., Any])


class _State:
    json = False


state = _State()


def _remember(_ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:
        state.json = True
    return value


def json_option(f: F) -> F:
    return click.option("--json", "as_json", is_flag=True, callback=_remember, is_eager=True,
                        help="Print the result (or the error) as JSON.")(f)


def jsonable(obj: Any) -> Any:
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    if isinstance(obj, list | tuple):
        return [jsonable(o) for o in obj]
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    return obj


def emit(obj: Any) -> None:
    click.echo(json.dumps(jsonable(obj), indent=2))
