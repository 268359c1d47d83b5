"""Capacity: how many more sandboxes of a template fit on this host, and the equivalent
memory allocation ratio an orchestrator (OpenStack Placement) can schedule by.

Per-sandbox host cost, first found of:

1. ``running``: the mean, over this template's running or paused sandboxes (of the policy,
   if one is given), of owned bytes plus QEMU's own bytes, from the daemon's ``owned``
   operation (``daemon/accounting.py``): what they cost now, compressed or not;
2. ``benchmark``: the newest density benchmark result (``density.json``) that measured the
   policy (``agentzip`` unless one is given): ``owned_bytes_avg_per_sandbox +
   qemu_own_bytes_avg``. Looked for in ``AZQ_DENSITY_RESULT`` (a file), then
   ``$AZQ_STATE_DIR/nightly/*/density.json`` (``azq bench nightly``), then
   ``./results/*/density.json`` (``azq bench density``, ``make demo``);
3. ``template``: nothing measured: the template's guest RAM, as if every sandbox held all
   of it (allocation ratio 1).

    fits             = floor((MemAvailable - reserve) / cost)
    allocation_ratio = guest RAM of the sandboxes that fit / what they cost = guest RAM / cost

The reserve is what the host keeps for itself (``AZQ_CAPACITY_RESERVE``, a size such as
``512M``; default 256 MiB). Reads the daemon through its client; the host through procfs.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from azqemu import config as config_mod
from azqemu.errors import ConfigError
from azqemu.host.procfs import read_meminfo
from azqemu.units import GIB, KIB, MIB

if TYPE_CHECKING:
    from azqemu.client import Client

DEFAULT_RESERVE_BYTES = 256 * MIB
DEFAULT_BENCH_POLICY = "agentzip"
LIVE_STATES = ("running", "paused", "blocked")


@dataclass(frozen=True)
class Capacity:
    template: str
    policy: str | None
    source: str                   # running | benchmark | template
    measured_sandboxes: int       # sandboxes the running figure is the mean of
    bench_file: str | None
    guest_bytes: int              # guest RAM of one sandbox of the template
    cost_bytes: int               # host cost of one sandbox (owned + QEMU's own)
    mem_total_bytes: int
    mem_available_bytes: int
    reserve_bytes: int
    manager_bytes: int            # the manager's RSS
    store_bytes: int              # the page store's arenas (tmpfs)
    fits: int                     # more sandboxes that fit now
    allocation_ratio: float       # guest RAM / host cost

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_size(value: str) -> int:
    """'512M', '2G', '1048576' (bytes), '64K' -> bytes."""
    v = value.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": KIB, "M": MIB, "G": GIB}.get(v[-1:], 1)
    try:
        n = float(v[:-1] if scale != 1 else v)
    except ValueError:
        raise ConfigError(f"cannot read size {value!r} (e.g. 512M, 2G)") from None
    if n < 0:
        raise ConfigError(f"size {value!r} is negative")
    return int(n * scale)


def reserve_from_env() -> int:
    value = os.environ.get("AZQ_CAPACITY_RESERVE", "").strip()
    return parse_size(value) if value else DEFAULT_RESERVE_BYTES


def bench_candidates(cfg: config_mod.Config | None = None, cwd: Path | None = None) -> list[Path]:
    """Density results, in the order they are looked for (newest first within each place)."""
    cfg = cfg or config_mod.load()
    out: list[Path] = []
    explicit = os.environ.get("AZQ_DENSITY_RESULT", "").strip()
    if explicit:
        out.append(Path(explicit))
    for root in (cfg.state_dir / "nightly", (cwd or Path.cwd()) / "results"):
        if root.is_dir():
            out += sorted(root.glob("*/density.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return out


def bench_cost(paths: list[Path], policy: str) -> tuple[int, Path] | None:
    """(per-sandbox host cost, file) from the first density result that measured ``policy``."""
    for p in paths:
        try:
            pol = json.loads(p.read_text())["policies"][policy]
            cost = float(pol["owned_bytes_avg_per_sandbox"]) + float(pol.get("qemu_own_bytes_avg", 0.0))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if math.isfinite(cost) and cost > 0:
            return int(cost), p
    return None


def estimate(*, template: str, policy: str | None, guest_bytes: int, costs: list[int],
             bench: tuple[int, Path] | None, meminfo: dict[str, int], reserve_bytes: int,
             manager_bytes: int = 0, store_bytes: int = 0) -> Capacity:
    """The figure from what was measured (pure: the tests give it numbers)."""
    if guest_bytes <= 0:
        raise ConfigError(f"template {template!r}: no guest memory size")
    if costs:
        source, cost, bench_file = "running", int(sum(costs) / len(costs)), None
    elif bench is not None:
        source, cost, bench_file = "benchmark", bench[0], str(bench[1])
    else:
        source, cost, bench_file = "template", guest_bytes, None
    cost = max(cost, 1)
    available = int(meminfo["MemAvailable"])
    fits = max(0, (available - reserve_bytes) // cost)
    return Capacity(template=template, policy=policy, source=source, measured_sandboxes=len(costs),
                    bench_file=bench_file, guest_bytes=guest_bytes, cost_bytes=cost,
                    mem_total_bytes=int(meminfo["MemTotal"]), mem_available_bytes=available,
                    reserve_bytes=reserve_bytes, manager_bytes=manager_bytes, store_bytes=store_bytes,
                    fits=int(fits), allocation_ratio=round(guest_bytes / cost, 4))


def measure(client: Client | None = None, *, template: str | None = None, policy: str | None = None,
            reserve_bytes: int | None = None) -> Capacity:
    """Ask the daemon for its templates and sandboxes' costs and work the figure out.

    Without ``template``: the template with the most sandboxes (or the only one)."""
    from azqemu.client import Client

    c = client or Client()
    templates = {t.name: t for t in c.template_list()}
    rows = [r.as_json() for r in c.list_sandboxes()]
    if template is None:
        if not templates:
            raise ConfigError("no template on this host (azq template create)")
        template = max(templates, key=lambda n: (sum(1 for r in rows if r["template"] == n), n))
    if template not in templates:
        raise ConfigError(f"no template {template!r} on this host")
    names = [r["name"] for r in rows if r["template"] == template and r.get("domain_state", r.get("state")) in LIVE_STATES
             and (policy is None or r.get("policy") == policy)]
    owned = c.owned(names).as_json()
    costs = [int(o["owned_bytes"]) + int(o["qemu_own_bytes"]) for o in owned["sandboxes"].values()
             if o.get("error") is None and o.get("owned_bytes")]
    bench = None if costs else bench_cost(bench_candidates(), policy or DEFAULT_BENCH_POLICY)
    return estimate(template=template, policy=policy, guest_bytes=int(templates[template].mem_mib) * MIB,
                    costs=costs, bench=bench, meminfo=read_meminfo(),
                    reserve_bytes=reserve_from_env() if reserve_bytes is None else reserve_bytes,
                    manager_bytes=int(owned.get("manager_rss_bytes", 0)),
                    store_bytes=int(owned.get("store_bytes", 0)))
