"""``azq events``: the daemon's recent sandbox lifecycle events (libvirt's, and the releases of
sandboxes whose domain ended outside azqemu; see docs/operations.md)."""

from __future__ import annotations

import json
import time

import click

from azqemu.daemon.client import Client

POLL_S = 0.5


def _line(e: dict) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(e["time"])) + f".{int(e['time'] * 1000) % 1000:03d}"
    return f"{stamp} {e['sandbox']:24} {e['event']:10} {e['detail']}"


@click.command()
@click.option("--since", type=float, default=0.0, help="Only events after this Unix time.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events until interrupted.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
def events(since: float, follow: bool, as_json: bool) -> None:
    """Recent lifecycle events of sandboxes (started, suspended, resumed, stopped, released)."""
    c = Client()
    while True:
        for e in c.call("events", since=since):
            click.echo(json.dumps(e) if as_json else _line(e))
            since = max(since, float(e["time"]))
        if not follow:
            return
        time.sleep(POLL_S)
