"""``azq bench``: benchmarks that print figures (JSON and a table), never pass/fail."""

from __future__ import annotations

import json
import time

import click
import numpy as np

from azqemu.daemon.client import Client
from azqemu.daemon.proc import ensure_daemon

BENCH_TEMPLATE = "azq-bench"


@click.group()
def bench() -> None:
    """Benchmarks (clone, restore, density, capacity)."""


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


def _progress(msg: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)


@bench.command("density")
@click.option("--workload", "workload_name", default="coding-agent", show_default=True,
              help="A built-in workload (coding-agent, data-processing, random-data, long-lived-heap, "
                   "long-tools, many-small-files) or a workload file.")
@click.option("--sandboxes", "-n", default=16, show_default=True, type=int)
@click.option("--policy", "policies", multiple=True,
              help="Policy to run (repeatable; default: none, none-cow, linux, agentzip).")
@click.option("--scale", default="full", show_default=True, help="Workload scale: full or small.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--grace", "grace_s", default=1.0, show_default=True, type=float,
              help="Seconds of LLM wait before a policy compresses or reclaims.")
@click.option("--out", "out_dir", default=None, help="Directory for JSON, markdown and PNG plots.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON result instead of the table.")
def bench_density(workload_name: str, sandboxes: int, policies: tuple[str, ...], scale: str, seed: int,
                  grace_s: float, out_dir: str | None, as_json: bool) -> None:
    """Run one workload under each policy, side by side on this host, and compare memory and latency."""
    from pathlib import Path

    from azqemu.bench import density, report
    from azqemu.bench.workload import load

    wl = load(workload_name)
    pols = list(policies) or list(density.DEFAULT_POLICIES)
    with ensure_daemon():
        result = density.run_density(wl, sandboxes, pols, seed=seed, scale=scale, grace_s=grace_s,
                                     progress=_progress)
    out = Path(out_dir or f"results/density-{time.strftime('%Y%m%d-%H%M%S')}")
    files = report.write_report(result, out)
    diffs = density.outputs_identical(result)
    if as_json:
        click.echo(report.to_json(report.with_ratios(result)))
    else:
        report.print_table(result)
        click.echo(f"written: {files.json}, {files.markdown}"
                   + "".join(f", {p}" for p in (files.memory_png, files.latency_png) if p))
    for d in diffs:
        click.echo(f"azq: warning: {d}", err=True)


@bench.command("capacity")
@click.option("--workload", "workload_name", default="coding-agent", show_default=True,
              help="A built-in workload or a workload file.")
@click.option("--fanouts", default="4,8,16", show_default=True,
              help="Fan-outs to run, smallest first (at least two).")
@click.option("--policy", "policies", multiple=True,
              help="Policy to run (repeatable; default: none, none-cow, linux, agentzip).")
@click.option("--budget", default="auto", show_default=True,
              help="Memory budget: bytes, a size (16G, 512M) or auto (MemAvailable at start).")
@click.option("--scale", default="full", show_default=True, help="Workload scale: full or small.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--grace", "grace_s", default=1.0, show_default=True, type=float,
              help="Seconds of LLM wait before a policy compresses or reclaims.")
@click.option("--out", "out_dir", default=None, help="Directory for JSON, markdown and the PNG plot.")
@click.option("--json", "as_json", is_flag=True, help="Print the JSON result instead of the table.")
@click.option("--from", "from_dir", default=None,
              help="Fit again from an earlier sweep's --out directory (its density-nN.json): run nothing.")
def bench_capacity(workload_name: str, fanouts: str, policies: tuple[str, ...], budget: str, scale: str,
                   seed: int, grace_s: float, out_dir: str | None, as_json: bool, from_dir: str | None) -> None:
    """Run the density benchmark at increasing fan-outs, fit host cost = fixed + marginal x N per
    policy, and say how many sandboxes fit in the budget (on host cost, and with QEMU's own memory)."""
    from pathlib import Path

    from azqemu.bench import capacity, density, report
    from azqemu.bench.workload import load

    wl = load(workload_name)
    ns = capacity.parse_fanouts(fanouts)
    budget_bytes = capacity.parse_budget(budget)
    pols = list(policies) or list(density.DEFAULT_POLICIES)
    out = Path(out_dir or f"results/capacity-{time.strftime('%Y%m%d-%H%M%S')}")

    def keep(n: int, result: dict) -> None:
        report.write_report(result, out, prefix=f"density-n{n}")

    if from_dir:
        result = capacity.refit(Path(from_dir), budget_bytes)
        out = Path(out_dir or from_dir)
    else:
        with ensure_daemon():
            result = capacity.run_capacity(wl, ns, pols, budget_bytes=budget_bytes, seed=seed, scale=scale,
                                           grace_s=grace_s, progress=_progress, on_density=keep)
    files = capacity.write_report(result, out)
    if as_json:
        click.echo(capacity.to_json(result), nl=False)
    else:
        capacity.print_table(result)
        click.echo(f"written: {files.json}, {files.markdown}" + (f", {files.png}" if files.png else ""))
    failed = {p: v["failed_steps"] for p, v in result["policies"].items() if v.get("failed_steps")}
    if failed:
        click.echo(f"azq: warning: failed steps {failed}", err=True)
    for w in capacity.warnings(result):
        click.echo(f"azq: warning: {w}", err=True)


@bench.command("nightly")
@click.option("--results", "results_dir", default="/var/lib/azqemu/nightly", show_default=True)
@click.option("--sandboxes", "-n", default=16, show_default=True, type=int)
@click.option("--tolerance", default=0.15, show_default=True, type=float,
              help="Relative worsening that counts as a regression.")
def bench_nightly(results_dir: str, sandboxes: int, tolerance: float) -> None:
    """Run the default density set into a dated directory; flag regressions against the last run."""
    import json as json_mod
    from pathlib import Path

    from azqemu.bench import density, report
    from azqemu.bench.workload import load

    root = Path(results_dir)
    previous = sorted(p for p in root.glob("*/density.json")) if root.exists() else []
    with ensure_daemon():
        result = density.run_density(load("coding-agent"), sandboxes,
                                     list(density.DEFAULT_POLICIES) + ["agentzip-no-prefetch"],
                                     progress=_progress)
    out = root / time.strftime("%Y-%m-%d-%H%M%S")
    files = report.write_report(result, out)
    report.print_table(result)
    click.echo(f"written: {files.json}")
    if previous:
        prev = json_mod.loads(previous[-1].read_text())
        regressions = report.compare_nightly(prev, result, tolerance)
        for r in regressions:
            click.echo(f"REGRESSION {r}")
        if regressions:
            raise SystemExit(3)
        click.echo(f"no regression against {previous[-1].parent.name}")
