"""Sandbox life-cycle commands: template, clone, exec, pause, resume, destroy, list, dominfo.

Each is a request to the manager daemon through the typed API client (``azqemu.client``);
``--json`` prints the API's own models. ``azq exec`` exits with the command's exit code and
reserves 124-127 for its own failures (README.md, exit codes).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import click

from azqemu.api.models import DEFAULT_GRACE_S, SandboxInfo
from azqemu.cli.output import emit, json_option
from azqemu.client import Client
from azqemu.errors import AgentTimeout, AzqemuError, DaemonError, DaemonUnavailable, ExecError
from azqemu.units import fmt_bytes

# azq exec's own exit codes (as docker exec's): the command's exit code is passed through,
# these say that azqemu could not run it or see it finish.
EXEC_TIMED_OUT = 124      # the command did not finish within --timeout (killed in the guest)
EXEC_AZQEMU_ERROR = 125   # the daemon, the sandbox or the guest agent failed
EXEC_CANNOT_RUN = 126     # the guest agent could not start the command
EXEC_NOT_FOUND = 127      # ... because it does not exist
EXEC_BROKEN_PIPE = 141    # azq's stdout was closed (as a shell reports a death by SIGPIPE)


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
@click.option("--no-wait", is_flag=True, help="Print the job and return; poll it with 'azq job ID'.")
@json_option
def template_create(name: str, mem: str, vcpus: int, warmup: tuple[str, ...], no_wait: bool,
                    as_json: bool) -> None:
    """Boot the guest image, warm it up, and save it as template NAME (a daemon job)."""
    c = Client()
    job = c.template_create_job(name, mem_mib=parse_mem_mib(mem), vcpus=vcpus, warmup=list(warmup))
    if no_wait:
        if as_json:
            emit(job)
        else:
            click.echo(f"job {job.id}: template create {name} ({job.state})")
        return
    from azqemu.api.models import Template

    meta = Template.model_validate(c.wait_job(job.id))
    if as_json:
        emit(meta)
        return
    click.echo(f"template {name}: {meta.mem_mib} MiB, {meta.vcpus} vCPU, {meta.accel}, "
               f"device state {meta.devstate_bytes / 1024:.0f} KiB, RAM data {_size(meta.ram_data_bytes)}, "
               f"boot {meta.boot_s:.1f} s, created in {meta.create_s:.1f} s")


@template.command("list")
@json_option
def template_list(as_json: bool) -> None:
    """List templates."""
    rows = Client().template_list()
    if as_json:
        emit(rows)
        return
    click.echo(f"{'NAME':20} {'MEM':>8} {'VCPUS':>5} {'ACCEL':5} {'RAM DATA':>10} {'CLONES':>6}")
    for t in rows:
        click.echo(f"{t.name:20} {t.mem_mib:>5} MiB {t.vcpus:>5} {t.accel:5} "
                   f"{_size(t.ram_data_bytes):>10} {t.clones or 0:>6}")


@template.command("delete")
@click.argument("name")
@json_option
def template_delete(name: str, as_json: bool) -> None:
    """Delete template NAME (refused while clones of it exist)."""
    Client().template_delete(name)
    if as_json:
        emit({"name": name, "deleted": True})
    else:
        click.echo(f"template {name} deleted")


@click.command()
@click.argument("job_id", metavar="ID")
@click.option("--wait", "wait_s", default=0.0, show_default=True, type=click.FloatRange(0, 600),
              help="Seconds to wait for the job to finish.")
@json_option
def job(job_id: str, wait_s: float, as_json: bool) -> None:
    """Show a daemon job (template create): running, succeeded or failed."""
    j = Client().job(job_id, wait_s=wait_s)
    if as_json:
        emit(j)
        return
    click.echo(f"job {j.id} {j.kind}: {j.state}" + (f": {j.error.message}" if j.error else ""))


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
@click.option("--grace", "grace_s", default=DEFAULT_GRACE_S, show_default=True, type=float,
              help="Seconds of LLM wait before the policy compresses or reclaims.")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE", help="A label on every clone (repeatable).")
@click.option("--ttl", "ttl_s", type=float, default=None, help="Destroy the clones this many seconds from now.")
@json_option
def clone(template_name: str, count: int, name_prefix: str | None, sharing_domain: str, ram_mode: str,
          policy: str, grace_s: float, labels: tuple[str, ...], ttl_s: float | None, as_json: bool) -> None:
    """Start N sandboxes cloned from TEMPLATE."""
    rows = Client().clone(template_name, count=count, name_prefix=name_prefix, sharing_domain=sharing_domain,
                          ram_mode=None if ram_mode == "auto" else ram_mode, policy=policy, grace_s=grace_s,
                          labels=parse_labels(labels), ttl_s=ttl_s)
    if as_json:
        emit(rows)
        return
    for r in rows:
        click.echo(f"{r.name}: cloned from {r.template} ({r.ram_mode}) in {r.clone_s:.2f} s")


def exec_exit_code(exc: AzqemuError) -> int:
    """azq exec's code for an azqemu failure (never one a command could return by itself
    without meaning the same: 124 timed out, 126/127 cannot run, 125 anything else)."""
    if isinstance(exc, AgentTimeout):
        return EXEC_TIMED_OUT
    if isinstance(exc, ExecError):
        return EXEC_NOT_FOUND if "No such file" in str(exc) else EXEC_CANNOT_RUN
    return EXEC_AZQEMU_ERROR


@click.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("--timeout", "timeout_s", default=300.0, show_default=True, type=float, help="Seconds.")
@click.option("-i", "--stdin", "with_stdin", is_flag=True, help="Send azq's standard input to the command.")
@click.option("--kind", default=None, help="The tool's name: a resume brings back the pages the last call "
                                           "of this kind used (default: told from the command's words).")
@click.option("--stream/--no-stream", default=True, show_default=True,
              help="Print the output as the command writes it; --no-stream: all of it at its exit "
                   "(--json is always all at the exit).")
@json_option
@click.argument("argv", nargs=-1, type=click.UNPROCESSED, required=True)
def exec_(name: str, timeout_s: float, with_stdin: bool, kind: str | None, stream: bool, as_json: bool,
          argv: tuple[str, ...]) -> None:
    """Run a command in sandbox NAME through the guest agent: azq exec NAME -- CMD ARGS...

    Its stdout and stderr appear as it writes them (at most 16 MiB in all). Exits with the
    command's exit code; 124 if it timed out, 125 if azqemu failed (daemon, sandbox, guest
    agent, output past 16 MiB), 126 if the command could not be started, 127 if it was not found."""
    stdin = sys.stdin.buffer.read() if with_stdin else None
    try:
        if stream and not as_json:
            sys.exit(_exec_streamed(name, list(argv), timeout_s, stdin, kind))
        res = Client().exec(name, list(argv), timeout_s=timeout_s, stdin=stdin, kind=kind)
    except AzqemuError as exc:
        exc.exit_code = exec_exit_code(exc)
        raise
    logging.getLogger("azqemu").debug("exec in %s took %.3f s", name, res.duration_s)
    if as_json:
        out = res.as_json()
        out.update(stdout=res.stdout.decode(errors="replace"), stderr=res.stderr.decode(errors="replace"))
        emit(out)
    else:
        sys.stdout.buffer.write(res.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(res.stderr)
        sys.stderr.flush()
    sys.exit(res.exit_code)


def _exec_streamed(name: str, argv: list[str], timeout_s: float, stdin: bytes | None, kind: str | None) -> int:
    """Write the command's output as it comes; its exit code. A reader of our stdout that
    leaves (``| head``) ends the stream, which stops the command in the guest."""
    outs = {"stdout": sys.stdout.buffer, "stderr": sys.stderr.buffer}
    with Client() as c:
        events = c.exec_stream(name, argv, timeout_s=timeout_s, stdin=stdin, kind=kind)
        try:
            for ev in events:
                out = outs.get(ev["event"])
                if out is not None:
                    out.write(ev["data"])
                    out.flush()
                elif ev["event"] == "exit":
                    logging.getLogger("azqemu").debug("exec in %s took %.3f s", name, ev.get("duration_s", 0.0))
                    return int(ev["exit_code"])
        except BrokenPipeError:
            events.close()   # type: ignore[attr-defined]
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error at exit
            return EXEC_BROKEN_PIPE
    raise DaemonError(f"the exec stream of {name!r} ended before the command's exit")


def _simple(op: str, verb: str) -> click.Command:
    @click.command(op)
    @click.argument("name")
    @json_option
    def cmd(name: str, as_json: bool) -> None:
        getattr(Client(), op)(name)
        if as_json:
            emit({"name": name, op: True})
        else:
            click.echo(f"{name} {verb}")

    cmd.help = f"{op.capitalize()} sandbox NAME."
    return cmd


pause = _simple("pause", "paused")
destroy = _simple("destroy", "destroyed")


@click.command()
@click.argument("name")
@click.option("--no-prefetch", is_flag=True, help="Do not put the hot set back first.")
@json_option
def resume(name: str, no_prefetch: bool, as_json: bool) -> None:
    """Resume sandbox NAME (a compressed one gets its hot pages back first)."""
    r = Client().resume(name, prefetch=not no_prefetch)
    if as_json:
        emit(r)
        return
    extra = (f": {r.prefetched_pages} hot pages back in {r.prefetch_s * 1000:.1f} ms"
             if r.prefetched_pages else "")
    click.echo(f"{name} resumed in {r.resume_s * 1000:.1f} ms{extra}")


@click.command()
@click.argument("name")
@json_option
def compress(name: str, as_json: bool) -> None:
    """Pause sandbox NAME and compress its RAM into the page store (it stays paused)."""
    r = Client().compress(name)
    if as_json:
        emit(r)
        return
    kinds = ", ".join(f"{k} {v}" for k, v in r.pages.items() if v)
    click.echo(f"{name}: {r.resident_pages} resident pages -> {r.stored_pages} stored "
               f"({_size(r.stored_bytes)}), {r.raw_pages} kept resident"
               + (f" ({r.raw_untried_pages} incompressible, unchanged: not tried)" if r.raw_untried_pages else "")
               + f"; {kinds}; "
               f"{r.total_s * 1000:.0f} ms" + (" (cancelled by a resume)" if r.cancelled else ""))


@click.command()
@click.argument("name")
@click.argument("phase", type=click.Choice(["wait", "tool"]))
@json_option
def phase(name: str, phase: str, as_json: bool) -> None:
    """Tell azqemu that sandbox NAME now waits for its LLM, or that a tool call is coming."""
    r = Client().phase(name, phase)
    if as_json:
        emit(r)
        return
    extra = f" (resumed in {r.resume_s * 1000:.1f} ms)" if r.resume_s is not None else ""
    click.echo(f"{name}: {phase}{extra}")


@click.command("list")
@click.option("--state", default=None, help="Only sandboxes in this state (running, paused, gone, ...).")
@click.option("--template", default=None, help="Only clones of this template.")
@click.option("--sharing-domain", default=None, help="Only sandboxes of this sharing domain.")
@click.option("--label", "labels", multiple=True, metavar="KEY[=VALUE]",
              help="Only sandboxes with this label (repeatable: all must match).")
@json_option
def list_(state: str | None, template: str | None, sharing_domain: str | None, labels: tuple[str, ...],
          as_json: bool) -> None:
    """List sandboxes with state, template and memory (read from the records and libvirt, without
    memory figures, when no daemon runs)."""
    try:
        rows = Client().list_sandboxes(state=state, template=template, sharing_domain=sharing_domain,
                                       label=list(labels) or None)
    except DaemonUnavailable as exc:
        rows = _offline_rows(exc)
        want = {"state": state, "template": template, "sharing_domain": sharing_domain}
        from azqemu.daemon.tags import matches, parse_selector

        selectors = [parse_selector(sel) for sel in labels]
        rows = [r for r in rows if all(v is None or getattr(r, k) == v for k, v in want.items())
                and matches({"labels": r.labels}, selectors)]   # labels are in the records
    if as_json:
        emit(rows)
        return
    _table(rows)


def _offline_rows(why: DaemonUnavailable) -> list[SandboxInfo]:
    """``azq list`` with the daemon down: the records on disk, each domain's state from libvirt
    (``gone`` if it has none); a note on stderr says so. Without libvirt either: the error."""
    from dataclasses import asdict

    from azqemu.errors import DomainNotFound
    from azqemu.virt.clones import SandboxRepo
    from azqemu.virt.host import Host

    records = SandboxRepo().list()
    try:
        host = Host()
    except AzqemuError:
        raise why from None
    rows = []
    try:
        for rec in records:
            try:
                dom = host.get_domain(rec.name)
                dstate, pid = dom.state(), dom.qemu_pid()
            except DomainNotFound:
                dstate, pid = "gone", None
            rows.append(SandboxInfo.model_validate(dict(asdict(rec), state=dstate, domain_state=dstate,
                                                        qemu_pid=pid, resident_bytes=None, stored_bytes=None,
                                                        source="records")))
    finally:
        host.close()
    click.echo(f"azq: {why}; listing from the records and libvirt (no memory figures)", err=True)
    return rows


def parse_labels(pairs: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for p in pairs:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"expected KEY=VALUE, got {p!r}", param_hint="--label")
        out[key] = value
    return out


@click.command()
@click.argument("name")
@click.option("--label", "labels", multiple=True, metavar="KEY=VALUE",
              help="Set a label (repeatable; KEY= removes it).")
@click.option("--replace", is_flag=True, help="Replace every label instead of merging.")
@click.option("--ttl", "ttl_s", type=float, default=None, help="A new time to live, in seconds from now.")
@json_option
def tag(name: str, labels: tuple[str, ...], replace: bool, ttl_s: float | None, as_json: bool) -> None:
    """Set labels and a time to live on sandbox NAME."""
    info = Client().update(name, labels=parse_labels(labels), ttl_s=ttl_s, replace_labels=replace)
    if as_json:
        emit(info)
        return
    shown = ", ".join(f"{k}={v}" for k, v in sorted(info.labels.items())) or "no labels"
    click.echo(f"{name}: {shown}" + (f"; expires in {info.expires_at - time.time():.0f} s"
                                      if info.expires_at is not None else ""))


def _table(rows: list[SandboxInfo]) -> None:
    click.echo(f"{'NAME':24} {'STATE':9} {'TEMPLATE':16} {'DOMAIN':10} {'MODE':6} {'RESIDENT':>10} {'STORED':>10}")
    for r in rows:
        click.echo(f"{r.name:24} {r.state:9} {r.template:16} {r.sharing_domain:10} "
                   f"{r.ram_mode:6} {_size(r.resident_bytes):>10} {_size(r.stored_bytes):>10}")


@click.command()
@click.argument("name")
@json_option
def dominfo(name: str, as_json: bool) -> None:
    """Show one sandbox (every field the daemon reports)."""
    info = Client().dominfo(name).as_json()
    if as_json:
        emit(info)
        return
    for k, v in info.items():
        if k.endswith("_bytes") and isinstance(v, int | None):
            v = _size(v)
        click.echo(f"{k + ':':16} {_shown(v)}")


@click.command()
@click.argument("name")
@json_option
def domstats(name: str, as_json: bool) -> None:
    """Per-sandbox statistics, as virsh domstats prints them: state, phase, owned, resident
    and stored bytes, page faults, compress and restore counters (bytes in plain numbers)."""
    stats = Client().domstats(name)
    if as_json:
        emit(stats)
        return
    click.echo(f"Domain: '{stats.name}'")
    for k, v in stats.as_json().items():
        if k != "name":
            click.echo(f"  {k}={'' if v is None else v}")


def _shown(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k}={fmt_bytes(x) if k.endswith('_bytes') and isinstance(x, int) else x}"
                         for k, x in v.items())
    return str(v)
