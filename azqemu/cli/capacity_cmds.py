"""Capacity and OpenStack Placement: ``azq capacity`` and ``azq placement sync``.

How many more sandboxes of a template fit on this host and the memory allocation ratio that
says so (``azqemu.daemon.capacity``), and that figure published to Placement as this host's
MEMORY_MB inventory (``azqemu.placement``). See docs/operations.md.
"""

from __future__ import annotations

import json
import os

import click

from azqemu import config as config_mod
from azqemu.cli.output import json_option
from azqemu.daemon import capacity as capacity_mod
from azqemu.units import MIB, fmt_bytes


def _reserve(value: str | None) -> int | None:
    return None if value is None else capacity_mod.parse_size(value)


_template_opt = click.option("--template", "template", default=None,
                             help="Template (default: the one with the most sandboxes).")
_policy_opt = click.option("--policy", "policy", default=None,
                           help="Count only sandboxes of this policy (and read this policy's benchmark figure).")
_reserve_opt = click.option("--reserve", "reserve", default=None,
                            help="Memory the host keeps for itself, e.g. 512M "
                                 "(default: AZQ_CAPACITY_RESERVE or 256M).")


@click.command()
@_template_opt
@_policy_opt
@_reserve_opt
@json_option
def capacity(template: str | None, policy: str | None, reserve: str | None, as_json: bool) -> None:
    """How many more sandboxes of a template fit on this host, and the allocation ratio."""
    cap = capacity_mod.measure(template=template, policy=policy, reserve_bytes=_reserve(reserve))
    if as_json:
        click.echo(json.dumps(cap.as_dict(), indent=2))
        return
    src = {"running": f"measured on {cap.measured_sandboxes} running sandboxes",
           "benchmark": f"density benchmark {cap.bench_file}",
           "template": "nothing measured: the template's whole RAM"}[cap.source]
    click.echo(f"template {cap.template}" + (f", policy {cap.policy}" if cap.policy else "") + f": {src}")
    click.echo(f"  cost per sandbox  {fmt_bytes(cap.cost_bytes)} (guest RAM {fmt_bytes(cap.guest_bytes)})")
    click.echo(f"  available         {fmt_bytes(cap.mem_available_bytes)} - reserve {fmt_bytes(cap.reserve_bytes)}")
    click.echo(f"  fits              {cap.fits} more")
    click.echo(f"  allocation ratio  {cap.allocation_ratio:.2f}")


@click.group()
def placement() -> None:
    """OpenStack Placement: publish this host's memory inventory."""


@placement.command("sync")
@click.option("--url", default=None, help="Placement's URL (default: AZQ_PLACEMENT_URL, or Keystone's catalog).")
@click.option("--name", default=None, help="Resource provider name (default: kept one, or the host name).")
@_template_opt
@_policy_opt
@_reserve_opt
@json_option
def placement_sync(url: str | None, name: str | None, template: str | None, policy: str | None,
                   reserve: str | None, as_json: bool) -> None:
    """Create this host's resource provider if needed and set its MEMORY_MB inventory:
    total = MemTotal, reserved = manager + store + reserve, allocation_ratio from capacity."""
    from azqemu import placement as pl
    from azqemu.errors import ConfigError

    auth = None if os.environ.get("AZQ_PLACEMENT_TOKEN") else pl.keystone_login()
    url = url or os.environ.get("AZQ_PLACEMENT_URL") or (auth.url if auth else None)
    if not url:
        raise ConfigError("no Placement URL (--url, AZQ_PLACEMENT_URL or a Keystone catalog)")
    token = os.environ.get("AZQ_PLACEMENT_TOKEN") or (auth.token if auth else "admin")
    client = pl.Placement(url, token)
    cap = capacity_mod.measure(template=template, policy=policy, reserve_bytes=_reserve(reserve))
    reserved = cap.manager_bytes + cap.store_bytes + cap.reserve_bytes
    inv = pl.memory_inventory(cap.mem_total_bytes // MIB, -(-reserved // MIB), cap.allocation_ratio)
    out = pl.sync(client, config_mod.load().state_dir, inv, name=name)
    out["capacity"] = cap.as_dict()
    if as_json:
        click.echo(json.dumps(out, indent=2))
        return
    rp = out["provider"]
    click.echo(f"provider {rp['name']} ({rp['uuid']}){' created' if rp['created'] else ''}, "
               f"generation {rp['generation']}")
    click.echo(f"MEMORY_MB total {inv['total']} reserved {inv['reserved']} "
               f"allocation_ratio {inv['allocation_ratio']:g} (template {cap.template}, {cap.source})")
