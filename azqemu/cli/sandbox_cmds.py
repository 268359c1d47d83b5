"""Sandbox life-cycle commands: template, clone, exec, pause, resume, destroy, list, dominfo, daemon.

Everything but ``daemon`` is a request to the manager daemon over its unix socket.
"""

from __future__ import annotations

import base64
import json
import logging
import sys
from typing import Any

import click

from azqemu.daemon.client import Client
from azqemu.units import fmt_bytes


def _size(n: int | None) -> str:
    """A size for the tables, ``-`` where the daemon has none (a sandbox that is gone)."""
    return "-" if n is None else fmt_bytes(n)


def parse_mem_mib(value: str) -> int:
    """'512M', '1G', '512' (MiB) -> MiB."""
    v = value.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if v.endswith("G"):
            return int(float(v[:-1]) * 1024)
        if v.endswith("M"):
            return int(v[:-1])
        return int(v)
    except ValueError:
        raise click.BadParameter(f"cannot read memory size {value!r} (e.g. 512M, 1G)") from None


@click.group()
def template() -> None:
    """Create, list and delete templates."""


@template.command("create")
@click.argument("name")
@click.option("--mem", "mem", default="512M", show_default=True, help="Guest memory (e.g. 512M, 1G).")
@click.option("--vcpus", default=1, show_default=True, type=int)
@click.option("--warmup", multiple=True, help="A shell command run in the guest before saving (repeatable).")
def template_create(name: str, mem: str, vcpus: int, warmup: tuple[str, ...]) -> None:
    """Boot the guest image, warm it up, and save it as template NAME."""
    meta = Client().call("template_create", name=name, mem_mib=parse_mem_mib(mem), vcpus=vcpus,
                         warmup=list(warmup))
    click.echo(f"template {name}: {meta['mem_mib']} MiB, {meta['vcpus']} vCPU, {meta['accel']}, "
               f"device state {meta['devstate_bytes'] / 1024:.0f} KiB, RAM data {_size(meta['ram_data_bytes'])}, "
               f"boot {meta['boot_s']:.1f} s, created in {meta['create_s']:.1f} s")


@template.command("list")
@click.option("--json", "as_json", is_flag=True)
def template_list(as_json: bool) -> None:
    """List templates."""
    rows = Client().call("template_list")
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'NAME':20} {'MEM':>8} {'VCPUS':>5} {'ACCEL':5} {'RAM DATA':>10} {'CLONES':>6}")
    for t in rows:
        click.echo(f"{t['name']:20} {t['mem_mib']:>5} MiB {t['vcpus']:>5} {t['accel']:5} "
                   f"{_size(t['ram_data_bytes']):>10} {t['clones']:>6}")


@template.command("delete")
@click.argument("name")
def template_delete(name: str) -> None:
    """Delete template NAME (refused while clones of it exist)."""
    Client().call("template_delete", name=name)
    click.echo(f"template {name} deleted")


@click.command()
@click.argument("template_name", metavar="TEMPLATE")
@click.option("-n", "count", default=1, show_default=True, type=int, help="How many clones.")
@click.option("--name-prefix", default=None, help="Clone names are PREFIX0, PREFIX1, ... (default TEMPLATE-).")
@click.option("--sharing-domain", "--domain", "sharing_domain", default="default", show_default=True,
              help="Sharing domain (tenant/task): pages are deduplicated only within one. "
                   "(--domain is a deprecated alias, kept for one release.)")
@click.option("--mode", "ram_mode", type=click.Choice(["auto", "eager", "lazy", "cow"]), default="auto",
              show_default=True,
              help="How RAM is filled: copied (eager), served on first touch (lazy), or a "
                   "private mapping of the template (cow, for Linux's KSM/zram).")
@click.option("--policy", default="manual", show_default=True,
              help="Memory policy: manual, none, none-cow, linux, agentzip, agentzip-no-prefetch, "
                   "agentzip-no-sibling, agentzip-pressure (see docs/policies.md).")
@click.option("--grace", "grace_s", default=1.0, show_default=True, type=float,
              help="Seconds of LLM wait before the policy compresses or reclaims.")
@click.option("--json", "as_json", is_flag=True)
def clone(template_name: str, count: int, name_prefix: str | None, sharing_domain: str, ram_mode: str,
          policy: str, grace_s: float, as_json: bool) -> None:
    """Start N sandboxes cloned from TEMPLATE."""
    rows = Client().call("clone", template=template_name, count=count, name_prefix=name_prefix,
                         sharing_domain=sharing_domain, ram_mode=None if ram_mode == "auto" else ram_mode,
                         policy=policy, grace_s=grace_s)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for r in rows:
        click.echo(f"{r['name']}: cloned from {r['template']} ({r['ram_mode']}) in {r['clone_s']:.2f} s")


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("--timeout", "timeout_s", default=300.0, show_default=True, type=float, help="Seconds.")
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, required=True)
def exec_(name: str, timeout_s: float, argv: tuple[str, ...]) -> None:
    """Run a command in sandbox NAME through the guest agent: azq exec NAME -- CMD ARGS..."""
    res = Client().call("exec", name=name, argv=list(argv), timeout_s=timeout_s)
    sys.stdout.buffer.write(base64.b64decode(res["stdout_b64"]))
    sys.stdout.flush()
    sys.stderr.buffer.write(base64.b64decode(res["stderr_b64"]))
    sys.stderr.flush()
    logging.getLogger("azqemu").debug("exec in %s took %.3f s", name, res["duration_s"])
    sys.exit(res["exit_code"])


def _simple(op: str, verb: str) -> click.Command:
    @click.command(op)
    @click.argument("name")
    def cmd(name: str) -> None:
        Client().call(op, name=name)
        click.echo(f"{name} {verb}")

    cmd.help = f"{op.capitalize()} sandbox NAME."
    return cmd


pause = _simple("pause", "paused")
destroy = _simple("destroy", "destroyed")


@click.command()
@click.argument("name")
@click.option("--no-prefetch", is_flag=True, help="Do not put the hot set back first.")
def resume(name: str, no_prefetch: bool) -> None:
    """Resume sandbox NAME (a compressed one gets its hot pages back first)."""
    r = Client().call("resume", name=name, prefetch=not no_prefetch)
    extra = (f": {r['prefetched_pages']} hot pages back in {r['prefetch_s'] * 1000:.1f} ms"
             if r.get("prefetched_pages") else "")
    click.echo(f"{name} resumed in {r['resume_s'] * 1000:.1f} ms{extra}")


@click.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def compress(name: str, as_json: bool) -> None:
    """Pause sandbox NAME and compress its RAM into the page store (it stays paused)."""
    r = Client().call("compress", name=name)
    if as_json:
        click.echo(json.dumps(r, indent=2))
        return
    kinds = ", ".join(f"{k} {v}" for k, v in r["pages"].items() if v)
    click.echo(f"{name}: {r['resident_pages']} resident pages -> {r['stored_pages']} stored "
               f"({_size(r['stored_bytes'])}), {r['raw_pages']} kept resident; {kinds}; "
               f"{r['total_s'] * 1000:.0f} ms" + (" (cancelled by a resume)" if r["cancelled"] else ""))


@click.command()
@click.argument("name")
@click.argument("phase", type=click.Choice(["wait", "tool"]))
def phase(name: str, phase: str) -> None:
    """Tell azqemu that sandbox NAME now waits for its LLM, or that a tool call is coming."""
    r = Client().call("phase", name=name, phase=phase)
    extra = f" (resumed in {r['resume_s'] * 1000:.1f} ms)" if "resume_s" in r else ""
    click.echo(f"{name}: {phase}{extra}")


@click.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_(as_json: bool) -> None:
    """List sandboxes with state, template and memory."""
    rows = Client().call("list")
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    _table(rows)


def _table(rows: list[dict[str, Any]]) -> None:
    click.echo(f"{'NAME':24} {'STATE':9} {'TEMPLATE':16} {'DOMAIN':10} {'MODE':6} {'RESIDENT':>10} {'STORED':>10}")
    for r in rows:
        click.echo(f"{r['name']:24} {r['state']:9} {r['template']:16} {r['sharing_domain']:10} "
                   f"{r['ram_mode']:6} {_size(r.get('resident_bytes')):>10} {_size(r.get('stored_bytes')):>10}")


@click.command()
@click.argument("name")
@click.option("--json", "as_json", is_flag=True)
def dominfo(name: str, as_json: bool) -> None:
    """Show one sandbox."""
    info = Client().call("dominfo", name=name)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for k, v in info.items():
        if k.endswith("_bytes"):
            v = _size(v)
        click.echo(f"{k + ':':16} {v}")


@click.command()
def daemon() -> None:
    """Run the manager daemon in the foreground (socket /run/azqemu/azqemu.sock)."""
    from azqemu.daemon.server import serve

    logging.getLogger().addHandler(logging.StreamHandler(sys.stderr))
    serve()
