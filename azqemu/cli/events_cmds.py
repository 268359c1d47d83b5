"""``azq events``: what happened to sandboxes, recent events or, with ``--follow``, as they
happen (the API's event stream, ``GET /v1/events?follow=true``): libvirt's lifecycle events
and azqemu's own (created, phase, compress, resume, failed, destroyed, released; see
docs/operations.md). ``--sandbox`` and ``--event`` are applied by the daemon."""

from __future__ import annotations

import json
import time

import click

from azqemu.api.models import Event
from azqemu.cli.output import json_option
from azqemu.client import Client
from azqemu.units import fmt_bytes


def _figures(e: Event) -> str:
    """The key fields of azqemu's own events, after the detail."""
    parts = []
    if e.stored_bytes is not None:
        parts.append(f"stored {fmt_bytes(e.stored_bytes)}")
    if e.stored_pages is not None:
        parts.append(f"{e.stored_pages} pages")
    if e.prefetched_bytes is not None:
        parts.append(f"prefetched {fmt_bytes(e.prefetched_bytes)}")
    if e.left_pages:
        parts.append(f"{e.left_pages} pages left to first touch")
    if e.duration_s is not None:
        parts.append(f"{e.duration_s:.3f} s")
    if e.reason is not None and e.reason != e.detail:
        parts.append(e.reason)
    return ", ".join(parts)


def line(e: Event) -> str:
    """One readable line: time, sandbox, source, kind, detail, and the kind's figures."""
    stamp = time.strftime("%H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}"
    figures = _figures(e)
    text = f"{e.detail}  [{figures}]" if figures else e.detail
    return f"{stamp} {e.sandbox:24} {e.source:7} {e.event:10} {text}".rstrip()


@click.command()
@click.option("--since", type=float, default=0.0, help="Only events after this Unix time.")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events until interrupted.")
@click.option("--sandbox", "sandbox", metavar="NAME", help="Only this sandbox's events.")
@click.option("--event", "kinds", metavar="KIND", multiple=True,
              help="Only events of this kind (repeatable): created, phase, compress, resume, failed, "
                   "destroyed, released, or a libvirt event (started, suspended, resumed, stopped, ...).")
@json_option  # one JSON object per line
def events(since: float, follow: bool, sandbox: str | None, kinds: tuple[str, ...], as_json: bool) -> None:
    """Events of sandboxes: libvirt's lifecycle events and azqemu's own."""
    c = Client()
    event = list(kinds) or None
    stream = (c.follow_events(since, sandbox=sandbox, event=event) if follow
              else iter(c.events(since, sandbox=sandbox, event=event)))
    for e in stream:
        click.echo(json.dumps(e.as_json()) if as_json else line(e))
