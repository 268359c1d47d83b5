"""``azq cp``: files into and out of a sandbox, as ``docker cp`` copies them (through the guest
agent, at most 16 MiB a file; see azqemu/daemon/files.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from azqemu.cli.output import emit, json_option
from azqemu.client import Client
from azqemu.errors import ConfigError
from azqemu.names import is_valid_name


def _remote(spec: str) -> tuple[str, str] | None:
    """``NAME:/path`` -> (NAME, /path); None for a local path."""
    name, sep, path = spec.partition(":")
    return (name, path) if sep and path.startswith("/") and is_valid_name(name) else None


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc


@click.command()
@click.argument("src")
@click.argument("dst")
@json_option
def cp(src: str, dst: str, as_json: bool) -> None:
    """Copy a file into or out of a sandbox: azq cp LOCAL NAME:/PATH, azq cp NAME:/PATH LOCAL
    ('-' is standard input or output)."""
    rsrc, rdst = _remote(src), _remote(dst)
    if (rsrc is None) == (rdst is None):
        raise click.UsageError("exactly one of SRC and DST must be NAME:/absolute/path")
    c = Client()
    if rdst is not None:
        data = sys.stdin.buffer.read() if src == "-" else _read(src)
        written = c.put_file(rdst[0], rdst[1], data)
        if as_json:
            emit(written)
        else:
            click.echo(f"{written.size_bytes} bytes -> {rdst[0]}:{rdst[1]}", err=True)
        return
    assert rsrc is not None
    data = c.get_file(rsrc[0], rsrc[1])
    if dst == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        try:
            Path(dst).write_bytes(data)
        except OSError as exc:
            raise ConfigError(f"cannot write {dst}: {exc.strerror or exc}") from exc
    if as_json and dst != "-":
        emit({"name": rsrc[0], "path": rsrc[1], "size_bytes": len(data), "local": dst})
    elif dst != "-":
        click.echo(f"{rsrc[0]}:{rsrc[1]} -> {len(data)} bytes", err=True)
