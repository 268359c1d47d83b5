"""The capacity sweep: how many sandboxes of one template fit in a memory budget, per policy.

``run_capacity`` runs the density benchmark (``density.run_density``, every policy side by
side) at increasing fan-outs, one fan-out after the other, and ``summarize`` fits per policy a
line through the host cost of guest memory at each fan-out:

    host_cost(N) = fixed + marginal * N          (least squares, numpy.polyfit)

``marginal`` is what one more sandbox costs the host, ``fixed`` what the policy costs with no
sandbox at all (the idle manager's growth, the store's and zram's fixed parts; the template's
RAM image exists before the idle baseline and is not in it). The sandboxes that fit in a
budget are then

    fit_host_cost = floor((budget - fixed) / marginal)
    fit_with_qemu = floor((budget - fixed) / (marginal + QEMU's own memory per sandbox))

the first the figure that carries over to a KVM host (where QEMU's own memory is a few tens
of MiB), the second the one for this host as measured (TCG's translation cache included).

Host cost per density run: ``host_cost_bytes_avg`` when the density result has it, otherwise
``host_used_bytes_avg - qemu_own_bytes_avg * N`` (the same definition, DESIGN.md "Benchmark
definitions"; ``qemu_own_bytes_avg`` is per sandbox).

Each run measures above the host as it was idle at its own start, and so above the manager as it
was then: growth of the manager that a policy's run leaves behind (a first compression's
warm-up: the template's index, code paths run once, heap it keeps; +14 MiB at 16 sandboxes,
docs/figures.md session 27) would count in that policy's first point only and tilt its line (at
4, 8, 16 a 14 MiB one-time growth lowers the slope by ~1 MiB a sandbox). So every point carries
what the policy's own runs at smaller fan-outs left in the manager (``manager_carried_bytes``:
per earlier run, the manager's anonymous memory once its sandboxes were gone, the next run's
``manager_anon_at_start_bytes`` or the density run's ``manager_after``, minus at its start):
one-time growth lands in ``fixed``, where it belongs, and only in the policy that caused it.
Density results without those fields, or merged from several rounds, carry nothing.

The result is the stable JSON contract of ``azq bench capacity --json`` (DESIGN.md):

    {"workload": s, "budget_bytes": n, "fanouts": [N, ...],
     "policies": {P: {"marginal_host_cost_bytes": n, "fixed_host_cost_bytes": n,
                      "fit_host_cost": N, "fit_with_qemu": N,
                      "tool_latency_median_s": {"N": x}}}}

plus, per policy, the points of the fit and what they were made of (``points``), and the
fit's quality (``r2``). A figure that cannot be fitted (fewer than two fan-outs with a
measurement, or a marginal cost that is not positive) is null, never a made-up number.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from azqemu.errors import ConfigError
from azqemu.richout import table_console
from azqemu.units import GIB, KIB, MIB, fmt_mib

POLICY_ORDER = ("none", "none-cow", "linux", "agentzip")
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "K": KIB, "M": MIB, "G": GIB, "T": GIB << 10}
MAX_FANOUT = 4096

DensityRunner = Callable[..., dict[str, Any]]


# ---------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------

def parse_fanouts(text: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16]: at least two different fan-outs, each 1..4096, sorted, unique."""
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"fan-outs: expected numbers separated by commas (4,8,16), got {text!r}") from None
    if len(vals) < 2:
        raise ConfigError(f"fan-outs: a line needs at least two different fan-outs, got {text!r}")
    if vals[0] < 1 or vals[-1] > MAX_FANOUT:
        raise ConfigError(f"fan-outs: each must be 1-{MAX_FANOUT}, got {text!r}")
    return vals


def parse_budget(text: str | None) -> int | None:
    """A memory budget: bytes ('17179869184'), a size ('16G', '512MiB', '1.5T'), or 'auto' /
    None for the host's MemAvailable at the start of the sweep (returned as None)."""
    if text is None or text.strip().lower() == "auto":
        return None
    m = SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"budget: expected bytes, a size such as 16G, or auto, got {text!r}")
    value = int(float(m.group(1)) * _SCALE[m.group(2).upper()])
    if value <= 0:
        raise ConfigError(f"budget: must be positive, got {text!r}")
    return value


def mem_available_bytes() -> int:
    from azqemu.host.procfs import read_meminfo
    return int(read_meminfo()["MemAvailable"])


# ---------------------------------------------------------------------------------------
# The fit (pure: density results in, the capacity result out)
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Point:
    """One policy at one fan-out, as the density run measured it."""

    sandboxes: int
    host_cost_bytes: float
    host_used_bytes: float
    qemu_own_bytes_per_sandbox: float
    owned_bytes: float
    tool_latency_median_s: float
    tool_latency_p95_s: float
    failed_steps: int
    host_cost_source: str        # "measured" (host_cost_bytes_avg) or "derived" (used - QEMU's own)
    manager_bytes: float = float("nan")  # the manager's anonymous memory above idle (else its RSS)
    manager_carried_bytes: float = 0.0   # its growth before this run, since the sweep began (in the costs)


def _num(pol: dict[str, Any], key: str) -> float:
    v = pol.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return float("nan")
    return float(v)


def growth_left_bytes(density: dict[str, Any]) -> dict[str, float]:
    """Per policy of one density run, the manager's anonymous memory its run left behind: at the
    start of the run after it (policies run in the order listed), or once the whole density run
    was over, minus at its own start. Empty for a result merged from several rounds (the order
    changes between rounds); a policy without the manager's figures is left out."""
    if len(density.get("rounds") or []) > 1:
        return {}
    names = list(density.get("policies", {}))
    starts = [_num(density["policies"][p], "manager_anon_at_start_bytes") for p in names]
    ends = starts[1:] + [_num(density.get("manager_after") or {}, "anon_bytes")]
    return {p: e - s for p, s, e in zip(names, starts, ends, strict=True) if math.isfinite(e - s)}


def point_of(pol: dict[str, Any], sandboxes: int, carried_bytes: float = 0.0) -> Point:
    """The host cost of one policy in one density result (measured, or derived until the
    density benchmark reports it), plus ``carried_bytes``: what the policy's earlier runs left
    in the manager (``growth_left_bytes``), which this run's idle baseline holds."""
    used = _num(pol, "host_used_bytes_avg")
    qemu = _num(pol, "qemu_own_bytes_avg")
    cost = _num(pol, "host_cost_bytes_avg")
    source = "measured"
    if not math.isfinite(cost):
        cost = used - (qemu if math.isfinite(qemu) else 0.0) * sandboxes
        source = "derived"
    lat = pol.get("tool_latency_s") or {}
    # The manager above itself at the run's start, plus what it carries; older results: above
    # the idle manager before the density run, else its RSS.
    manager = _num(pol, "manager_anon_bytes_avg") - _num(pol, "manager_anon_at_start_bytes") + carried_bytes
    if not math.isfinite(manager):
        manager = _num(pol, "manager_anon_above_idle_bytes_avg")
    if not math.isfinite(manager):
        manager = _num(pol, "manager_rss_bytes_avg")
    return Point(sandboxes=sandboxes, host_cost_bytes=cost + carried_bytes, host_used_bytes=used + carried_bytes,
                 qemu_own_bytes_per_sandbox=qemu, owned_bytes=_num(pol, "owned_bytes_avg"),
                 tool_latency_median_s=_num(lat, "median"), tool_latency_p95_s=_num(lat, "p95"),
                 failed_steps=int(pol.get("failed_steps", 0) or 0), host_cost_source=source,
                 manager_bytes=manager, manager_carried_bytes=carried_bytes)


@dataclass(frozen=True)
class Fit:
    fixed_bytes: float
    marginal_bytes: float
    r2: float


def fit_line(ns: list[int], costs: list[float]) -> Fit | None:
    """Least-squares line cost = fixed + marginal * n over the finite points; None with
    fewer than two different fan-outs."""
    pts = [(float(n), float(c)) for n, c in zip(ns, costs) if math.isfinite(c)]
    if len({n for n, _ in pts}) < 2:
        return None
    x = np.array([n for n, _ in pts])
    y = np.array([c for _, c in pts])
    marginal, fixed = np.polyfit(x, y, 1)
    resid = y - (fixed + marginal * x)
    ss_tot = float(np.sum((y - y.mean()) ** 2))
    r2 = 1.0 - float(np.sum(resid ** 2)) / ss_tot if ss_tot > 0 else 1.0
    return Fit(float(fixed), float(marginal), r2)


def sandboxes_that_fit(budget_bytes: float, fixed_bytes: float, per_sandbox_bytes: float) -> int | None:
    """floor((budget - fixed) / per sandbox), at least 0; None when the cost per sandbox is
    not positive (a fit that says sandboxes are free says nothing about capacity)."""
    if not (math.isfinite(per_sandbox_bytes) and per_sandbox_bytes > 0 and math.isfinite(fixed_bytes)):
        return None
    return max(0, math.floor((budget_bytes - fixed_bytes) / per_sandbox_bytes))


def ordered(names: list[str]) -> list[str]:
    known = [p for p in POLICY_ORDER if p in names]
    return known + sorted(p for p in names if p not in POLICY_ORDER)


def summarize(workload: str, budget_bytes: int, densities: dict[int, dict[str, Any]],
              *, budget_source: str = "given") -> dict[str, Any]:
    """The capacity result from density results keyed by fan-out (the JSON contract)."""
    fanouts = sorted(densities)
    names: list[str] = []
    for n in fanouts:
        names += [p for p in densities[n]["policies"] if p not in names]
    policies: dict[str, Any] = {}
    left = {n: growth_left_bytes(densities[n]) for n in fanouts}
    for name in ordered(names):
        at = [n for n in fanouts if name in densities[n]["policies"]]
        pts = [point_of(densities[n]["policies"][name], n, sum(left[m].get(name, 0.0) for m in at if m < n))
               for n in at]
        fit = fit_line([p.sandboxes for p in pts], [p.host_cost_bytes for p in pts])
        qemu = [p.qemu_own_bytes_per_sandbox for p in pts if math.isfinite(p.qemu_own_bytes_per_sandbox)]
        qemu_per = float(np.mean(qemu)) if qemu else 0.0
        used_fit = fit_line([p.sandboxes for p in pts], [p.host_used_bytes for p in pts])
        owned_fit = fit_line([p.sandboxes for p in pts], [p.owned_bytes for p in pts])
        acct_fit = fit_line([p.sandboxes for p in pts], [p.owned_bytes + p.manager_bytes for p in pts])
        policies[name] = {
            "marginal_host_cost_bytes": fit.marginal_bytes if fit else None,
            "fixed_host_cost_bytes": fit.fixed_bytes if fit else None,
            "fit_host_cost": sandboxes_that_fit(budget_bytes, fit.fixed_bytes, fit.marginal_bytes) if fit else None,
            # A marginal cost that is not positive is noise: QEMU's part does not make it a figure.
            "fit_with_qemu": (sandboxes_that_fit(budget_bytes, fit.fixed_bytes, fit.marginal_bytes + qemu_per)
                              if fit and fit.marginal_bytes > 0 else None),
            "tool_latency_median_s": {str(p.sandboxes): p.tool_latency_median_s for p in pts},
            "tool_latency_p95_s": {str(p.sandboxes): p.tool_latency_p95_s for p in pts},
            "qemu_own_bytes_per_sandbox": qemu_per,
            "marginal_host_used_bytes": used_fit.marginal_bytes if used_fit else None,
            # The daemon's per-sandbox accounting: blind to the manager and the host, but not
            # moved by other work on the host either (a cross-check on a shared host).
            "marginal_owned_bytes": owned_fit.marginal_bytes if owned_fit else None,
            # Owned plus the manager: what the daemon accounts, the host cost without the
            # host-wide noise (no page cache, no KSM metadata); its fit beside the headline's.
            "marginal_accounted_bytes": acct_fit.marginal_bytes if acct_fit else None,
            "fixed_accounted_bytes": acct_fit.fixed_bytes if acct_fit else None,
            "fit_accounted": (sandboxes_that_fit(budget_bytes, acct_fit.fixed_bytes, acct_fit.marginal_bytes)
                              if acct_fit else None),
            "fit_r2": fit.r2 if fit else None,
            "failed_steps": sum(p.failed_steps for p in pts),
            "host_cost_source": sorted({p.host_cost_source for p in pts}),
            "points": [p.__dict__ for p in pts],
        }
    return {"workload": workload, "budget_bytes": int(budget_bytes), "budget_source": budget_source,
            "fanouts": fanouts, "policies": policies}


MIN_R2 = 0.8


def warnings(result: dict[str, Any]) -> list[str]:
    """What makes a fit untrustworthy, one line each (the figures stay in the result)."""
    out = []
    for name in ordered(list(result["policies"])):
        pol = result["policies"][name]
        m, r2 = pol.get("marginal_host_cost_bytes"), pol.get("fit_r2")
        if m is None:
            out.append(f"{name}: no fit (fewer than two fan-outs measured)")
        elif m <= 0:
            out.append(f"{name}: host cost does not grow with the fan-out ({fmt_mib(m)} per sandbox): "
                       "host-wide memory moved under the sweep (other VMs or jobs on this host?)")
        elif r2 is not None and r2 < MIN_R2 and len(pol.get("points", [])) > 2:
            out.append(f"{name}: host cost is far from a line (r² {r2:.2f}): a noisy host or too few sandboxes")
        if any(p["host_cost_bytes"] < 0 for p in pol.get("points", [])):
            out.append(f"{name}: negative host cost at some fan-out: the idle baseline was not idle")
    return out


def validate(result: Any) -> None:
    """Refuse a capacity result that breaks the contract, with one line naming the key."""
    if not isinstance(result, dict):
        raise ConfigError("capacity result: expected a JSON object")
    for key in ("workload", "budget_bytes", "fanouts", "policies"):
        if key not in result:
            raise ConfigError(f"capacity result: missing key {key!r}")
    for name, pol in result["policies"].items():
        for key in ("marginal_host_cost_bytes", "fixed_host_cost_bytes", "fit_host_cost", "fit_with_qemu",
                    "tool_latency_median_s"):
            if key not in pol:
                raise ConfigError(f"capacity result: policies.{name} has no {key!r}")


# ---------------------------------------------------------------------------------------
# Running the sweep
# ---------------------------------------------------------------------------------------

def run_capacity(wl: Any, fanouts: list[int], policies: list[str], *, budget_bytes: int | None = None,
                 seed: int = 0, scale: str = "full", grace_s: float | None = None,
                 grace_by_policy: dict[str, float] | None = None,
                 progress: Callable[[str], None] = lambda _m: None,
                 on_density: Callable[[int, dict[str, Any]], None] = lambda _n, _r: None,
                 runner: DensityRunner | None = None) -> dict[str, Any]:
    """Run the density benchmark at each fan-out (smallest first) and fit. ``budget_bytes``
    None means the host's MemAvailable now, before the first run. ``on_density(N, result)``
    sees every density result as it completes (the CLI writes them out)."""
    from azqemu.bench import density

    run = runner or density.run_density
    source = "given"
    if budget_bytes is None:
        budget_bytes, source = mem_available_bytes(), "MemAvailable at start"
    kwargs: dict[str, Any] = {"seed": seed, "scale": scale, "progress": progress}
    if grace_s is not None:
        kwargs["grace_s"] = grace_s
    if grace_by_policy:
        kwargs["grace_by_policy"] = grace_by_policy
    results: dict[int, dict[str, Any]] = {}
    for n in sorted(set(fanouts)):
        progress(f"capacity: fan-out {n} ({', '.join(policies)})")
        results[n] = run(wl, n, list(policies), **kwargs)
        on_density(n, results[n])
    out = summarize(wl.name, budget_bytes, results, budget_source=source)
    out.update({"seed": seed, "scale": scale})
    return out


DENSITY_FILE_RE = re.compile(r"^density-n(\d+)\.json$")


def load_densities(directory: Path) -> dict[int, dict[str, Any]]:
    """The density results an earlier sweep wrote (``density-nN.json`` in its --out
    directory), keyed by fan-out: to fit again without running anything."""
    out: dict[int, dict[str, Any]] = {}
    for f in sorted(directory.glob("density-n*.json")):
        m = DENSITY_FILE_RE.match(f.name)
        if not m:
            continue
        try:
            out[int(m.group(1))] = json.loads(f.read_text())
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot read density result {f}: {err}") from err
    if len(out) < 2:
        raise ConfigError(f"{directory}: needs density-nN.json for at least two fan-outs, found {sorted(out)}")
    return out


def refit(directory: Path, budget_bytes: int | None = None) -> dict[str, Any]:
    """Fit again from an earlier sweep's directory. The budget: as given, else the one that
    sweep used (its capacity.json), else MemAvailable now."""
    dens = load_densities(directory)
    source = "given"
    prev: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        prev = json.loads((directory / "capacity.json").read_text())
    if budget_bytes is None and isinstance(prev.get("budget_bytes"), int):
        budget_bytes, source = prev["budget_bytes"], str(prev.get("budget_source", "earlier sweep"))
    if budget_bytes is None:
        budget_bytes, source = mem_available_bytes(), "MemAvailable now"
    out = summarize(str(next(iter(dens.values())).get("workload", "?")), budget_bytes, dens, budget_source=source)
    out.update({k: prev[k] for k in ("seed", "scale") if k in prev})
    return out


# ---------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------

def _finite(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if isinstance(o, np.generic):
        return _finite(o.item())
    return o


def to_json(result: dict[str, Any]) -> str:
    """Strict JSON (NaN and infinities as null)."""
    return json.dumps(_finite(result), indent=1, allow_nan=False) + "\n"


def _mib(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else fmt_mib(x, 0, thousands=True, unit=False)


def _int(x: int | None) -> str:
    return "—" if x is None else f"{x:,}"


def _s(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.2f}"


def _title(result: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} {result[k]}" for k in ("scale", "seed") if k in result)
    return (f"capacity: {result['workload']}, fan-outs {', '.join(map(str, result['fanouts']))}, "
            f"budget {fmt_mib(result['budget_bytes'], 0, thousands=True)}" + (f" ({extra})" if extra else ""))


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: the fit per policy, then host cost and median latency per fan-out."""
    fanouts = result["fanouts"]
    headers = ["policy", "fixed MiB", "MiB/sandbox", "QEMU MiB/sbx", "fit (host cost)", "fit (with QEMU)", "r²",
               "accounted MiB/sandbox", "fit (accounted)"]
    headers += [f"cost@{n}" for n in fanouts] + [f"p50 s@{n}" for n in fanouts]
    rows = []
    for name in ordered(list(result["policies"])):
        pol = result["policies"][name]
        by_n = {p["sandboxes"]: p for p in pol.get("points", [])}
        r2 = pol.get("fit_r2")
        rows.append([name, _mib(pol["fixed_host_cost_bytes"]), _mib(pol["marginal_host_cost_bytes"]),
                     _mib(pol.get("qemu_own_bytes_per_sandbox")), _int(pol["fit_host_cost"]),
                     _int(pol["fit_with_qemu"]), "—" if r2 is None else f"{r2:.2f}",
                     _mib(pol.get("marginal_accounted_bytes")), _int(pol.get("fit_accounted"))]
                    + [_mib(by_n[n]["host_cost_bytes"]) if n in by_n else "—" for n in fanouts]
                    + [_s(pol["tool_latency_median_s"].get(str(n))) for n in fanouts])
    return headers, rows


CAPTION = ("host cost = host used above idle - QEMU's own memory, averaged over each run (MiB); "
           "fit = floor((budget - fixed) / per sandbox), with QEMU: QEMU's own memory added per sandbox")


def rich_tables(result: dict[str, Any]) -> list[Any]:
    """The terminal tables, each within 80 columns: the fit per policy, then host cost and
    median tool-call latency per fan-out (rows) and policy (columns)."""
    from rich import box
    from rich.table import Table
    validate(result)
    names = ordered(list(result["policies"]))
    fit = Table(title=_title(result), box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1),
                collapse_padding=True, caption="MiB; fit: sandboxes in the budget on host cost alone, and with "
                "QEMU's own memory added per sandbox; acct: the same fit on owned + manager memory (the "
                "daemon's accounting, not moved by other work on the host)")
    for k, h in enumerate(("policy", "fixed", "per sbx", "QEMU/sbx", "fit", "fit+QEMU", "r²", "acct/sbx",
                           "fit acct")):
        fit.add_column(h, justify="left" if k == 0 else "right", no_wrap=True)
    for name in names:
        pol = result["policies"][name]
        r2 = pol.get("fit_r2")
        fit.add_row(name, _mib(pol["fixed_host_cost_bytes"]), _mib(pol["marginal_host_cost_bytes"]),
                    _mib(pol.get("qemu_own_bytes_per_sandbox")), _int(pol["fit_host_cost"]),
                    _int(pol["fit_with_qemu"]), "—" if r2 is None else f"{r2:.2f}",
                    _mib(pol.get("marginal_accounted_bytes")), _int(pol.get("fit_accounted")))
    per = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True,
                caption="host cost MiB / median tool call s, per fan-out")
    per.add_column("N", justify="right", no_wrap=True)
    for name in names:
        per.add_column(name, justify="right", no_wrap=True)
    for n in result["fanouts"]:
        cells = []
        for name in names:
            pol = result["policies"][name]
            pt = next((p for p in pol.get("points", []) if p["sandboxes"] == n), None)
            cost = _mib(pt["host_cost_bytes"]) if pt else "—"
            cells.append(f"{cost} / {_s(pol['tool_latency_median_s'].get(str(n)))}")
        per.add_row(str(n), *cells)
    return [fit, per]


def print_table(result: dict[str, Any], console: Any = None) -> None:
    tables = rich_tables(result)
    con = console or table_console(*tables)
    for t in tables:
        con.print(t)


def markdown_table(result: dict[str, Any]) -> str:
    validate(result)
    headers, rows = table_rows(result)
    lines = [f"### {_title(result)}", "", "| " + " | ".join(headers) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines + ["", CAPTION + "."]) + "\n"


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Host cost against fan-out (points and fitted line per policy), and median tool latency
    against fan-out; None when there is nothing to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    pols = [(n, result["policies"][n]) for n in ordered(list(result["policies"]))]
    pols = [(n, p) for n, p in pols if p.get("points")]
    if not pols:
        return None
    fig = Figure(figsize=(9, 7), dpi=110)
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = np.linspace(0, max(result["fanouts"]), 50)
    for k, (name, pol) in enumerate(pols):
        color = f"C{k}"
        pts = pol["points"]
        ns = [p["sandboxes"] for p in pts]
        ax1.plot(ns, [p["host_cost_bytes"] / MIB for p in pts], "o", color=color, label=name)
        if pol["marginal_host_cost_bytes"] is not None:
            ax1.plot(xs, (pol["fixed_host_cost_bytes"] + pol["marginal_host_cost_bytes"] * xs) / MIB, "--",
                     color=color, lw=1.2, label=f"{name} fit: {pol['marginal_host_cost_bytes'] / MIB:,.1f} MiB/sandbox")
        acct = [(p["owned_bytes"] + p.get("manager_bytes", float("nan"))) / MIB for p in pts]
        ax1.plot(ns, acct, "s", mfc="none", color=color, label=f"{name} accounted (owned + manager)")
        if pol.get("marginal_accounted_bytes") is not None:
            ax1.plot(xs, (pol["fixed_accounted_bytes"] + pol["marginal_accounted_bytes"] * xs) / MIB, ":",
                     color=color, lw=1.0)
        ax2.plot(ns, [p["tool_latency_median_s"] for p in pts], "o-", color=color, label=name)
    ax1.set_ylabel("host cost of guest memory (MiB)")
    ax1.set_title(_title(result), fontsize="medium")
    ax2.set_ylabel("median tool call (s)")
    ax2.set_xlabel("sandboxes (fan-out)")
    ax2.set_xticks(result["fanouts"])
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    # Negative host costs (a host that was not idle) stay visible: the axis starts below them.
    lo = min([0.0] + [p["host_cost_bytes"] / MIB for _, pol in pols for p in pol["points"]
                      if math.isfinite(p["host_cost_bytes"])])
    ax1.set_ylim(bottom=lo * 1.1)
    ax2.set_ylim(bottom=0)
    ax1.legend(loc="upper left", fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path)
    return path


@dataclass(frozen=True)
class CapacityFiles:
    json: Path
    markdown: Path
    png: Path | None


def write_report(result: dict[str, Any], out_dir: Path) -> CapacityFiles:
    """capacity.json (the contract and the points), capacity.md and capacity.png in out_dir."""
    validate(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "capacity.json"
    js.write_text(to_json(result))
    md = out_dir / "capacity.md"
    md.write_text(markdown_table(result))
    return CapacityFiles(js, md, plot(result, out_dir / "capacity.png"))
