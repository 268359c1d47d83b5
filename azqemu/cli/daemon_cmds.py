"""``azq daemon``: run the manager daemon, or ask one how it is (``azq daemon status``)."""

from __future__ import annotations

import time

import click

from azqemu.cli.output import emit, json_option


@click.group(invoke_without_command=True)
@click.pass_context
def daemon(ctx: click.Context) -> None:
    """Run the manager daemon in the foreground (the /v1 API on /run/azqemu/azqemu.sock;
    its log: $AZQ_LOG_DIR/daemon.log, default /var/log/azqemu/daemon.log)."""
    if ctx.invoked_subcommand is None:
        _serve()


@daemon.command("run")
def daemon_run() -> None:
    """Run the manager daemon in the foreground (what 'azq daemon' alone does)."""
    _serve()


def _serve() -> None:
    from azqemu.daemon.logsetup import log_to_daemon_log
    from azqemu.daemon.server import serve

    log_to_daemon_log()
    serve()


@daemon.command("status")
@json_option
def daemon_status(as_json: bool) -> None:
    """Whether a daemon answers on the socket: its pid, uptime, sandboxes, version.

    Exits 0 when it answers, 1 (DaemonUnavailable) when none does."""
    from azqemu.client import Client

    c = Client(timeout_s=10)
    t0 = time.monotonic()
    p = c.ping()
    latency_s = time.monotonic() - t0
    if as_json:
        emit(dict(p.as_json(), socket=c.where, latency_s=latency_s))
        return
    up = time.time() - p.started_at
    click.echo(f"azqemu daemon {p.pid} at {c.where}: up {up:.0f} s, {p.sandboxes} sandbox(es), "
               f"version {p.version}, API {p.api}, answered in {latency_s * 1000:.1f} ms")
