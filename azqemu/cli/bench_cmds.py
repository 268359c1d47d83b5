"""``azq bench``: benchmarks that print figures (JSON and a table), never pass/fail."""

from __future__ import annotations

import json
import time

import click
import numpy as np

from azqemu.daemon.client import Client
from azqemu.daemonproc import ensure_daemon

BENCH_TEMPLATE = "azq-bench"


@click.group()
def bench() -> None:
    """Benchmarks (clone, restore, density)."""


def ensure_template(c: Client, name: str, mem_mib: int = 512) -> None:
    if not any(t["name"] == name for t in c.call("template_list")):
        c.call("template_create", name=name, mem_mib=mem_mib, vcpus=1,
               warmup=["cd /workspace/* && python3 -m unittest -q"])


@bench.command("clone")
@click.option("-n", "count", default=16, show_default=True, type=int)
@click.option("--template", "template_name", default=BENCH_TEMPLATE, show_default=True,
              help="Template to clone (made from the guest image if missing).")
@click.option("--mode", "ram_mode", type=click.Choice(["auto", "eager", "lazy"]), default="auto")
@click.option("--json", "as_json", is_flag=True)
def bench_clone(count: int, template_name: str, ram_mode: str, as_json: bool) -> None:
    """Clone N sandboxes at once: per-clone time (start to guest agent answering) and total."""
    with ensure_daemon():
        c = Client()
        ensure_template(c, template_name)
        t0 = time.monotonic()
        rows = c.call("clone", template=template_name, count=count, name_prefix="azq-bench-clone-",
                      ram_mode=None if ram_mode == "auto" else ram_mode)
        total_s = time.monotonic() - t0
        try:
            per = np.array([r["clone_s"] for r in rows])
            result = {"clones": len(rows), "per_clone_s": {"median": float(np.median(per)),
                                                           "p95": float(np.percentile(per, 95))},
                      "total_s": total_s, "ram_mode": rows[0]["ram_mode"]}
        finally:
            for r in rows:
                c.call("destroy", name=r["name"])
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"{'clones':>8} {'median s':>9} {'p95 s':>7} {'total s':>8} mode")
        click.echo(f"{result['clones']:>8} {result['per_clone_s']['median']:>9.3f} "
                   f"{result['per_clone_s']['p95']:>7.3f} {result['total_s']:>8.2f} {result['ram_mode']}")


@bench.command("restore")
@click.option("--hot-mib", default=100, show_default=True, type=click.IntRange(min=1),
              help="Working set the repeated tool call touches (the hot set of the resume).")
@click.option("--template", "template_name", default=BENCH_TEMPLATE, show_default=True,
              help="Template to clone (made from the guest image if missing).")
@click.option("--json", "as_json", is_flag=True)
def bench_restore(hot_mib: int, template_name: str, as_json: bool) -> None:
    """Compress and resume a lazy clone around a repeated tool call: per-fault service time,
    the guest's stall per fault, prefetch throughput, resume time, faults removed by prefetch."""
    from azqemu.bench import restore_bench

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(msg, err=True)

    with ensure_daemon():
        c = Client()
        ensure_template(c, template_name)
        result = restore_bench.run(c, template=template_name, hot_mib=hot_mib, progress=progress)
    result["targets_met"] = restore_bench.targets_met(result)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(restore_bench.format_table(result))
