"""``azq demo``: the main job on its embedded default.

The density benchmark at a small size: the built-in coding-agent workload on 4 sandboxes
(a few steps each), under the policies none, none-cow, linux and agentzip, one after the
other on this host, ending with the comparison table (owned memory, host memory, tool-call
latency, and the ratios against none and none-cow). Files land in ./results/demo-<time>/.
"""

from __future__ import annotations

import time
from pathlib import Path

import click

from azqemu.cli.bench_cmds import _progress
from azqemu.daemon.proc import ensure_daemon

DEMO_POLICIES = ("none", "none-cow", "linux", "agentzip")


@click.command()
@click.option("--sandboxes", "-n", default=4, show_default=True, type=int)
@click.option("--workload", "workload_name", default="coding-agent", show_default=True)
def demo(sandboxes: int, workload_name: str) -> None:
    """Run the density benchmark at demo size and print the comparison table."""
    from azqemu.bench import density, report
    from azqemu.bench.workload import load

    wl = load(workload_name)
    with ensure_daemon():
        result = density.run_density(wl, sandboxes, list(DEMO_POLICIES), scale="small", progress=_progress)
    out = Path(f"results/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    files = report.write_report(result, out)
    report.print_table(result)
    for d in density.outputs_identical(result):
        click.echo(f"azq: warning: {d}", err=True)
    click.echo(f"written: {files.json}, {files.markdown}")
