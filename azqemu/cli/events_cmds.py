"""``azq events``: the daemon's sandbox lifecycle events (libvirt's, and the releases of
sandboxes whose domain ended outside azqemu; see docs/operations.md), recent ones or, with
``--follow``, as they happen (the API's event stream, ``GET /v1/events?follow=true``)."""

from __future__ import annotations

import json
import time

import click

from azqemu.api.models import Event
from azqemu.cli.output import json_option
from azqemu.client import Client


def _line(e: Event) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}"
    return f"{stamp} {e.sandbox:24} {e.event:10} {e.detail}"


@click.command()
@click.option("--since", type=float, default=0.0, help="Only events after this Unix time.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events until interrupted.")
@json_option  # one JSON object per line
def events(since: float, follow: bool, as_json: bool) -> None:
    """Lifecycle events of sandboxes (started, suspended, resumed, stopped, released)."""
    c = Client()
    stream = c.follow_events(since) if follow else iter(c.events(since))
    for e in stream:
        click.echo(json.dumps(e.as_json()) if as_json else _line(e))
