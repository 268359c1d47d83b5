"""`azq store` commands: the page store on tmpfs, checked and repaired with the daemon stopped.

The daemon holds the store open (its arenas mapped, its tables in memory) and commits
generations of it; a second process writing the same directory would race it. So ``azq store
check`` opens the store itself (``AZQ_SHM_DIR``/store) only when no daemon answers on the
daemon socket, and refuses with one line otherwise. Opening runs the same recovery as a
daemon's start: files no durable generation names are swept, unreadable sandbox indices are
quarantined (reported).
"""

from __future__ import annotations

import json
import socket

import click

from azqemu.cli.output import json_option
from azqemu.errors import ConfigError


@click.group()
def store() -> None:
    """The page store: check every stored page, repair what is damaged."""


def _daemon_running(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


@store.command("check")
@click.option("--repair", is_flag=True, help="Free the sandboxes with damaged pages (reported) and commit.")
@json_option
@click.option("--store-dir", type=click.Path(file_okay=False), default=None,
              help="The store directory (default: AZQ_SHM_DIR/store).")
def check_cmd(repair: bool, as_json: bool, store_dir: str | None) -> None:
    """Decode and verify every stored page; report each damaged sandbox and page.

    Exit status 1 when damage was found and not repaired. Needs the daemon stopped."""
    from pathlib import Path

    from azqemu import config as config_mod
    from azqemu.memory import storecheck
    from azqemu.memory.persist import STORE_FILE
    from azqemu.memory.store import PageStore

    cfg = config_mod.load()
    if _daemon_running(str(cfg.daemon_socket)):
        raise ConfigError(f"the azqemu daemon is running ({cfg.daemon_socket}): stop it first, "
                          "'azq store check' opens the store itself")
    root = Path(store_dir) if store_dir else cfg.shm_dir / "store"
    if not (root / STORE_FILE).exists():
        raise ConfigError(f"no page store at {root}")
    with PageStore(root) as st:
        report = storecheck.check_store(st)
        if repair and not report.ok:
            storecheck.repair(st, report)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    else:
        click.echo(f"page store {report.root}, generation {report.generation}: "
                   f"{len(report.sandboxes)} sandbox(es), {sum(s.pages for s in report.sandboxes)} pages")
        for name, reason in sorted(report.quarantined.items()):
            click.echo(f"  {name}: QUARANTINED at open, its pages are lost: {reason}")
        for s in report.sandboxes:
            if s.ok:
                click.echo(f"  {s.name}: {s.pages} pages ok")
            else:
                more = "" if s.damaged_pages <= len(s.damaged) else f" (+{s.damaged_pages - len(s.damaged)} more)"
                click.echo(f"  {s.name}: {s.damaged_pages} of {s.pages} pages DAMAGED: "
                           f"{', '.join(map(str, s.damaged))}{more}")
                for line in s.errors:
                    click.echo(f"      {line}")
        for name in report.repaired:
            click.echo(f"  repaired: freed {name} (a running domain of that name is failed at the daemon's start)")
    if not report.ok and not report.repaired:
        raise SystemExit(1)
