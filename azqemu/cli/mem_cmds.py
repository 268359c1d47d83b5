"""`azq mem` commands: guest-memory analysis and page-store tools."""

from __future__ import annotations

import json

import click

from azqemu.cli.output import json_option
from azqemu.units import fmt_bytes


@click.group()
def mem() -> None:
    """Guest memory: analyze compressibility, inspect the page store."""


def _template_path(name_or_path: str) -> str:
    """A template RAM image path, or an azqemu template's by name."""
    import os

    from azqemu.virt.templates import TemplateRepo

    if os.path.exists(name_or_path):
        return name_or_path
    repo = TemplateRepo()
    repo.get(name_or_path)  # TemplateNotFound: one clear line
    return str(repo.ram_path(name_or_path))


def _resolve_sandbox(name: str) -> str:
    """A RAM image path, or a running sandbox's RAM memfd (/proc/PID/fd/N) by its name."""
    import os

    from azqemu.client import Client
    from azqemu.errors import ConfigError
    from azqemu.host.procfs import find_ram_fd

    if os.path.exists(name):
        return name
    info = Client().dominfo(name).as_json()
    if info.get("ram_mode") == "cow" or not info.get("qemu_pid"):
        raise ConfigError(f"sandbox {name!r} has no RAM memfd to read (mode {info.get('ram_mode')})")
    return str(find_ram_fd(int(info["qemu_pid"])))


@mem.command("analyze")
@click.option("--template", "template", required=True,
              help="Template RAM image (a sparse file), or the name of an azqemu template.")
@click.argument("sandboxes", nargs=-1, required=True)
@json_option
@click.option("--sharing-domain", "--domain", "domain", default="analyze", show_default=True,
              help="Sharing domain of the sandboxes (--domain: deprecated alias).")
@click.option("--store-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the page store here (default: a scratch dir on /dev/shm, removed after).")
@click.option("--level", "zstd_level", type=click.IntRange(1, 3), default=1, show_default=True,
              help="zstd level of the encoder.")
@click.option("--effort", type=click.IntRange(1, 2), default=None, help="Encoder effort (default 1).")
def analyze_cmd(template: str, sandboxes: tuple[str, ...], as_json: bool, domain: str, store_dir: str | None,
                zstd_level: int, effort: int | None) -> None:
    """Compare azqemu's encoding of SANDBOX RAM images with the Linux model (KSM + zram).

    Each SANDBOX is a RAM image file or the name of a running sandbox (its live RAM is read
    through its QEMU's memfd, holes skipped). Read a sandbox while it is paused or idle for a
    consistent picture.
    """
    from azqemu.memory.analyze import analyze

    result = analyze(_template_path(template), list(sandboxes), domain=domain, resolver=_resolve_sandbox,
                     store_dir=store_dir, zstd_level=zstd_level, effort=effort)
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    from rich.console import Console
    from rich.table import Table

    az, lm, tp = result["azqemu"], result["linux_model"], result["throughput"]
    table = Table(title=f"{len(sandboxes)} sandbox(es), template {fmt_bytes(result['template']['bytes'])} "
                        "(counted separately)")
    table.add_column("kind")
    table.add_column("pages", justify="right")
    table.add_column("share", justify="right")
    table.add_column("before", justify="right")
    table.add_column("stored bytes", justify="right")
    table.add_column("ratio", justify="right")
    total_pages = max(1, sum(az["pages"].values()))
    for kind, k in az["by_kind"].items():
        ratio = "-" if k["ratio"] is None else f"{k['ratio']:.2f}x"
        table.add_row(kind, str(k["pages"]), f"{100 * k['pages'] / total_pages:.1f}%", fmt_bytes(k["bytes_before"]),
                      fmt_bytes(k["bytes_after"]), ratio)
    meta = az["blob_metadata_bytes"] + az["index_bytes"]
    table.add_row("metadata", "", "", "", fmt_bytes(meta), f"{100 * az['metadata_fraction']:.1f}% of after")
    console = Console()
    console.print(table)
    summary = Table(show_header=True)
    summary.add_column("")
    summary.add_column("before", justify="right")
    summary.add_column("after", justify="right")
    summary.add_column("ratio", justify="right")
    summary.add_row("azqemu", fmt_bytes(az["bytes_before"]), fmt_bytes(az["bytes_after"]), f"{az['ratio']:.2f}x")
    summary.add_row(f"Linux model (KSM + zram {lm['compressor']})", fmt_bytes(lm["bytes_before"]),
                    fmt_bytes(lm["bytes_after"]), f"{lm['ratio']:.2f}x")
    console.print(summary)
    console.print(f"azqemu / Linux: {result['azqemu_vs_linux']:.2f}x   encode {tp['encode_mib_s']:.0f} MiB/s   "
                  f"decode {tp['decode_mib_s']:.0f} MiB/s   (zstd backend {az['zstd_backend']})")
