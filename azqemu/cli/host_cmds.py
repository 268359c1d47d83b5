"""``azq doctor`` and ``azq host setup``."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import click

from azqemu.cli.output import emit, json_option

# A daemon that takes longer than this to answer a ping counts as not answering.
DOCTOR_PING_TIMEOUT_S = 5.0


@click.command()
@json_option
def doctor(as_json: bool) -> None:
    """Report what this host can do (KVM, libvirtd, userfaultfd, zram, zswap, KSM) and
    whether the azqemu daemon answers (its version and pid)."""
    from azqemu.client import Client
    from azqemu.host.doctor import FAIL, run_checks

    with Client(timeout_s=DOCTOR_PING_TIMEOUT_S) as client:
        def ping() -> tuple[int, str]:
            p = client.ping()
            return p.pid, p.version

        checks = run_checks(daemon=(ping, client.where))
    if as_json:
        click.echo(json.dumps([asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            line = f"{c.verdict.upper():4}  {c.name:12} {c.detail}"
            if c.advice:
                line += f"  -> {c.advice}"
            click.echo(line)
    sys.exit(1 if any(c.verdict == FAIL for c in checks) else 0)


@click.group()
def host() -> None:
    """Host set-up (libvirt configuration and daemons)."""


@host.command("setup")
@click.option("--restart", is_flag=True, help="Restart libvirtd even if it runs.")
@json_option
def setup(restart: bool, as_json: bool) -> None:
    """Configure libvirt and start virtlogd/libvirtd (with /dev/kvm hidden where KVM is unusable)."""
    from azqemu.host.doctor import _guest_kernel
    from azqemu.host.setup import setup_host

    done = setup_host(restart=restart, kernel=_guest_kernel())
    if as_json:
        emit({"done": done})
        return
    click.echo("; ".join(done) if done else "host already set up")


@host.command("recover")
@click.option("--setup", "undo_setup", is_flag=True,
              help="Also undo 'azq host setup' (qemu.conf block, libvirt hook); no azqemu domain may run.")
@json_option
def recover(undo_setup: bool, as_json: bool) -> None:
    """Put back what azqemu changed on this host (a killed benchmark's Linux configuration)."""
    from azqemu.host.setup import recover_host

    done = recover_host(setup=undo_setup)
    if as_json:
        emit({"done": done})
        return
    click.echo("; ".join(done) if done else "nothing to recover")


@host.command("install-service")
@click.option("--dest", type=click.Path(file_okay=False), default=None,
              help="Directory to write azqemu.service to (default /etc/systemd/system).")
@click.option("--no-reload", is_flag=True, help="Do not run 'systemctl daemon-reload'.")
@json_option
def install_service(dest: str | None, no_reload: bool, as_json: bool) -> None:
    """Install the daemon's systemd unit (not enabled; see docs/operations.md)."""
    from pathlib import Path

    from azqemu.host import service

    path = service.install(Path(dest) if dest else service.UNIT_DIR, reload=not no_reload)
    if as_json:
        emit({"unit": str(path)})
        return
    click.echo(f"installed {path}; start it with 'systemctl enable --now azqemu'")
