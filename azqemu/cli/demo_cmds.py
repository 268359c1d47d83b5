"""``azq demo``: the main job on its embedded default.

Until the density benchmark lands, the demo makes a template from the guest image, clones a
few sandboxes, runs a short coding-agent-like workload in each (through the guest agent),
prints what it did, and removes the sandboxes again.
"""

from __future__ import annotations

import base64
import time

import click

from azqemu.daemon.client import Client
from azqemu.daemonproc import ensure_daemon

DEMO_TEMPLATE = "azq-demo"
DEMO_STEPS = [
    "cat /proc/meminfo | head -3",
    "cd /workspace && ls",
    "cd /workspace/* && grep -rn 'def ' --include=*.py . | wc -l",
    "cd /workspace/* && python3 -m unittest -q 2>&1 | tail -1",
]


@click.command()
@click.option("--sandboxes", "-n", default=4, show_default=True, type=int)
@click.option("--keep", is_flag=True, help="Keep the sandboxes and the template afterwards.")
def demo(sandboxes: int, keep: bool) -> None:
    """Create a template, clone sandboxes, run an agent-like workload in them."""
    with ensure_daemon():
        c = Client()
        if not any(t["name"] == DEMO_TEMPLATE for t in c.call("template_list")):
            t0 = time.monotonic()
            c.call("template_create", name=DEMO_TEMPLATE, mem_mib=512, vcpus=1,
                   warmup=["cd /workspace/* && python3 -m unittest -q"])
            click.echo(f"template {DEMO_TEMPLATE} created in {time.monotonic() - t0:.1f} s")
        t0 = time.monotonic()
        rows = c.call("clone", template=DEMO_TEMPLATE, count=sandboxes, name_prefix="azq-demo-")
        per_clone = ", ".join(f"{r['clone_s']:.2f}" for r in rows)
        click.echo(f"{len(rows)} sandboxes cloned in {time.monotonic() - t0:.1f} s (per clone: {per_clone} s)")
        try:
            for step in DEMO_STEPS:
                for r in rows:
                    res = c.call("exec", name=r["name"], argv=["/bin/sh", "-c", step], timeout_s=120)
                    out = base64.b64decode(res["stdout_b64"]).decode(errors="replace").strip().splitlines()
                    click.echo(f"[{r['name']}] $ {step}  -> exit {res['exit_code']} in "
                               f"{res['duration_s'] * 1000:.0f} ms: {out[-1] if out else ''}")
            for s in c.call("list"):
                click.echo(f"{s['name']}: {s['state']}, resident RAM {(s['resident_bytes'] or 0) >> 20} MiB")
        finally:
            if not keep:
                for r in rows:
                    c.call("destroy", name=r["name"])
                click.echo(f"destroyed {len(rows)} sandboxes")
