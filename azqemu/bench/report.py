"""Density benchmark reports: JSON, a Markdown table, PNG plots, a terminal table, nightly checks.

The input is the density result dict, whose keys are a stable contract (DESIGN.md, "Figures
the benchmarks print"):

    {"workload": s, "sandboxes": N,
     "policies": {POLICY: {"owned_bytes_avg": n, "owned_bytes_peak": n, "host_used_bytes_avg": n,
                           "tool_latency_s": {"median": x, "p95": x},
                           "compress_s_total": x, "restore_s_total": x}}}

Optional keys this module understands (added, never renamed):
    policies[P]["series"] = {"t_s": [...], "owned_bytes": [...], "host_used_bytes": [...]}
        owned_bytes summed over the sandboxes at each sample (memory-over-time plot);
    policies[P]["tool_latencies_s"] = [...]  every tool call's latency (CDF plot);
    policies[P]["qemu_own_bytes_avg"], result["template_bytes"], result["seed"], result["scale"];
    policies[P]["host_cost_bytes_avg"], ["host_cost_bytes_peak"] (host used above idle minus
    QEMU's own memory), ["manager_anon_above_idle_bytes_avg"], ["compress_cpu_s_total"] and
    ["compress_cpu_loops_below_s_total"] (its part in C loops run below the guests while
    the rest ran above them: AZQ_COMPRESS_LOOPS_BELOW=1; 0 otherwise),
    ["compress_cpu_s_per_wait"] (per finished compression; null without one),
    ["compress_encoded_bytes_total"] and ["compress_cpu_s_per_encoded_mib"] (per MiB of pages
    new or changed since they were stored: about what the guest wrote; null without one).

Ratios are against both no-compression baselines: ``none`` (full-copy clones) and
``none-cow`` (copy-on-write clones, the stronger one): ratio = baseline host cost / policy
host cost (owned where a result has no host cost; the owned ratios are kept beside them as
``owned_ratio_vs_*``), so 4.0 means the policy needs a quarter of the memory. Slowdown =
policy median tool latency / none-cow's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from azqemu.bench import hostcpu, toolcalls
from azqemu.errors import ConfigError
from azqemu.richout import table_console
from azqemu.units import MIB, fmt_mib

# Known policies first, in this order; others follow alphabetically.
POLICY_ORDER = ("none", "none-cow", "linux", "azqemu-eager", "azqemu", "azqemu-lazy", "azqemu-prefetch")
REQUIRED_POLICY_KEYS = ("owned_bytes_avg", "owned_bytes_peak", "host_used_bytes_avg", "tool_latency_s",
                        "compress_s_total", "restore_s_total")

def ordered_policies(result: dict[str, Any]) -> list[str]:
    names = list(result.get("policies", {}))
    known = [p for p in POLICY_ORDER if p in names]
    return known + sorted(p for p in names if p not in POLICY_ORDER)


def validate(result: Any) -> None:
    """Refuse a result that breaks the contract, with one line naming the key."""
    if not isinstance(result, dict):
        raise ConfigError("density result: expected a JSON object")
    for key in ("workload", "sandboxes", "policies"):
        if key not in result:
            raise ConfigError(f"density result: missing key {key!r}")
    if not isinstance(result["policies"], dict) or not result["policies"]:
        raise ConfigError("density result: 'policies' must be a non-empty object")
    for name, pol in result["policies"].items():
        if not isinstance(pol, dict):
            raise ConfigError(f"density result: policies.{name} must be an object")
        for key in REQUIRED_POLICY_KEYS:
            if key not in pol:
                raise ConfigError(f"density result: policies.{name} has no {key!r}")
        lat = pol["tool_latency_s"]
        if not isinstance(lat, dict) or "median" not in lat or "p95" not in lat:
            raise ConfigError(f"density result: policies.{name}.tool_latency_s needs median and p95")


def _get(pol: dict[str, Any], metric: str) -> float | None:
    cur: Any = pol
    for part in metric.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return float(cur) if isinstance(cur, (int, float)) and not isinstance(cur, bool) else None


def _ratio(b: float | None, p: float | None) -> float | None:
    return b / p if b is not None and p is not None and b > 0 and p > 0 else None


def cost_basis(result: dict[str, Any]) -> str:
    """The figure the memory ratios are taken on: host cost when every policy has it."""
    pols = result["policies"].values()
    return "host_cost_bytes_avg" if all(_get(p, "host_cost_bytes_avg") is not None for p in pols) \
        else "owned_bytes_avg"


def ratios(result: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per policy: ratio_vs_none, ratio_vs_none_cow (memory: host cost, see cost_basis),
    owned_ratio_vs_none, owned_ratio_vs_none_cow, slowdown_vs_none_cow (latency)."""
    pols = result["policies"]
    basis = cost_basis(result)
    out: dict[str, dict[str, float | None]] = {}
    for name, pol in pols.items():
        row: dict[str, float | None] = {}
        for base, key in (("none", "ratio_vs_none"), ("none-cow", "ratio_vs_none_cow")):
            row[key] = _ratio(_get(pols.get(base, {}), basis), _get(pol, basis))
            row[f"owned_{key}"] = _ratio(_get(pols.get(base, {}), "owned_bytes_avg"), _get(pol, "owned_bytes_avg"))
        b = _get(pols.get("none-cow", {}), "tool_latency_s.median")
        p = _get(pol, "tool_latency_s.median")
        row["slowdown_vs_none_cow"] = p / b if b and p is not None else None
        out[name] = row
    return out


def round_spread(result: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """Per policy, each of SPREAD_FIGURES taken in each round on its own (the ratios within
    the round): {policy: {figure: [round 1, round 2, ...]}}; empty for a result of one round."""
    rounds = result.get("rounds") or []
    if len(rounds) < 2:
        return {}
    per_round = [ratios(rr) for rr in rounds]
    out: dict[str, dict[str, list[float]]] = {}
    for name in result["policies"]:
        fig: dict[str, list[float]] = {}
        for rr, rat in zip(rounds, per_round):
            pol = rr["policies"].get(name, {})
            values = {"host_cost_bytes_avg": _get(pol, "host_cost_bytes_avg"),
                      "owned_bytes_avg": _get(pol, "owned_bytes_avg"),
                      "tool_latency_median_s": _get(pol, "tool_latency_s.median"),
                      **rat.get(name, {})}
            for key, _label, _cell in SPREAD_FIGURES:
                v = values.get(key)
                if v is not None and math.isfinite(v):
                    fig.setdefault(key, []).append(v)
        out[name] = fig
    return out


def spread_lines(result: dict[str, Any]) -> list[str]:
    """One line per policy: each figure's range over the rounds (empty for one round)."""
    spread = round_spread(result)
    if not spread:
        return []
    orders = " / ".join("-".join(rr["order"]) for rr in result["rounds"])
    lines = [f"{len(result['rounds'])} rounds ({orders}); the figures above are the rounds' means, "
             "the ranges each round on its own (ratios within the round):"]
    for name in ordered_policies(result):
        fig = spread.get(name, {})
        cells = [f"{label} {cell(min(fig[key]))}-{cell(max(fig[key]))}"
                 for key, label, cell in SPREAD_FIGURES if fig.get(key)]
        lines.append(f"  {name}: " + ", ".join(cells))
    return lines


def idle_drift_note(result: dict[str, Any]) -> str:
    """How far the idle host moved across each policy (after its sandboxes are gone minus
    before they were made; each round's where there are rounds), or "" if not measured."""
    cells = []
    # A result of one round is its own only round.
    each_round = result.get("rounds") or [result]
    for name in ordered_policies(result):
        values = [v for rr in each_round
                  if (v := rr["policies"].get(name, {}).get("host_idle_drift_bytes")) is not None]
        if values:
            cells.append(f"{name} " + " / ".join(f"{v / MIB:+,.1f}" for v in values))
    if not cells:
        return ""
    return ("The idle host after each policy minus before it (MiB; per round where there are rounds): a drop "
            "means the first figure held memory the host was still freeing, and the policy's host cost is "
            "counted against the lower, later figure; a rise is memory that came and stayed, counted in the "
            "policy's host cost: " + "; ".join(cells) + ".")


def with_ratios(result: dict[str, Any]) -> dict[str, Any]:
    """A copy of the result with the ratios added to each policy (added keys, contract intact)
    and, for a result of several rounds, each figure per round (``rounds_spread``)."""
    out = json.loads(json.dumps(result, default=_json_default))
    for name, row in ratios(result).items():
        out["policies"][name].update(row)
    for name, fig in round_spread(result).items():
        out["policies"][name]["rounds_spread"] = fig
    return out


def _mib_cell(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else fmt_mib(x, thousands=True, unit=False)


def _x(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}x"


def _s(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.2f}"


# The figures whose spread over the rounds is stated (rounds.py): key, label, cell format.
SPREAD_FIGURES = (("host_cost_bytes_avg", "host cost MiB", _mib_cell), ("owned_bytes_avg", "owned MiB", _mib_cell),
                  ("tool_latency_median_s", "p50 s", _s), ("ratio_vs_none_cow", "vs none-cow", _x),
                  ("slowdown_vs_none_cow", "slowdown", _x))


HEADERS = ("policy", "host cost avg MiB", "host cost peak MiB", "vs none", "vs none-cow", "owned avg MiB",
           "owned peak MiB", "host used avg MiB", "QEMU own MiB/sandbox", "manager anon +MiB",
           "tool median s", "tool p95 s", "slowdown", "compress s", "compress CPU s", "restore s",
           "compress CPU s/wait")

QEMU_NOTE = ("QEMU's own memory (the process minus guest RAM) is set aside from host cost: it is the "
             "same for every policy, and here (TCG) mostly the translation cache; a KVM QEMU's own "
             "memory is a few tens of MiB.")


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    r = ratios(result)
    rows = []
    for name in ordered_policies(result):
        pol = result["policies"][name]
        rows.append([
            name, _mib_cell(_get(pol, "host_cost_bytes_avg")), _mib_cell(_get(pol, "host_cost_bytes_peak")),
            _x(r[name]["ratio_vs_none"]), _x(r[name]["ratio_vs_none_cow"]),
            _mib_cell(_get(pol, "owned_bytes_avg")), _mib_cell(_get(pol, "owned_bytes_peak")),
            _mib_cell(_get(pol, "host_used_bytes_avg")), _mib_cell(_get(pol, "qemu_own_bytes_avg")),
            _mib_cell(_get(pol, "manager_anon_above_idle_bytes_avg")),
            _s(_get(pol, "tool_latency_s.median")), _s(_get(pol, "tool_latency_s.p95")),
            _x(r[name]["slowdown_vs_none_cow"]), _s(_get(pol, "compress_s_total")),
            _s(_get(pol, "compress_cpu_s_total")), _s(_get(pol, "restore_s_total")),
            _cpu_wait(_get(pol, "compress_cpu_s_per_wait")),
        ])
    return rows


def _cpu_wait(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{x:.3f}"


def _title(result: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} {result[k]}" for k in ("scale", "seed") if k in result)
    return f"density: {result['workload']}, {result['sandboxes']} sandboxes" + (f" ({extra})" if extra else "")


def markdown_table(result: dict[str, Any]) -> str:
    validate(result)
    lines = [f"### {_title(result)}", "", "| " + " | ".join(HEADERS) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(HEADERS) - 1)) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(result)]
    on = "host cost" if cost_basis(result) == "host_cost_bytes_avg" else "owned (no host cost in this result)"
    notes = ["Host cost: host memory in use above idle minus QEMU's own memory, averaged over the run "
             "(tool phases and waits); it holds every resident guest page, the manager above idle, the "
             "store, zram and KSM. Owned: what the host spends on the sandboxes beyond what they all "
             f"share. Ratios are baseline / policy on {on}; slowdown is the median tool-call latency "
             "over none-cow's. Manager anon: the manager's own memory above the idle manager.", QEMU_NOTE]
    if "template_bytes" in result:
        notes.append(f"Template RAM image, counted once: {_mib_cell(float(result['template_bytes']))} MiB.")
    graces = {n: _get(p, "grace_s") for n, p in result["policies"].items()}
    if any(v is not None for v in graces.values()):
        notes.append("Grace (seconds of an LLM wait before the policy acts): "
                     + ", ".join(f"{n} {v:g}" for n, v in graces.items() if v is not None) + ".")
    own = {n: _get(p, "qemu_own_bytes_avg") for n, p in result["policies"].items()}
    if any(v is not None for v in own.values()):
        vals = [v for v in own.values() if v is not None]
        notes.append("QEMU's own memory per sandbox (not in owned or host cost): "
                     f"{_mib_cell(min(vals))}-{_mib_cell(max(vals))} MiB.")
    parts = {n: p["host_parts_bytes_avg"] for n, p in result["policies"].items() if p.get("host_parts_bytes_avg")}
    if parts:
        notes.append("Host memory above idle by kind (/proc/meminfo, MiB averaged over the run; page tables "
                     "and kernel objects are in host cost, in no sandbox figure): " + "; ".join(
                         f"{n}: " + ", ".join(f"{k.replace('_', ' ')} {_mib_cell(v)}" for k, v in d.items())
                         for n, d in parts.items()) + ".")
    if drift := idle_drift_note(result):
        notes.append(drift)
    if spread := spread_lines(result):
        notes.append(spread[0] + "\n" + "\n".join(f"- {line.strip()}" for line in spread[1:]) + "\n")
    if calls := toolcalls.markdown_note(result):
        notes.append(calls)
    if cpu := hostcpu.markdown_note(result):
        notes.append(cpu)
    return "\n".join(lines + [""] + notes) + "\n"


RICH_HEADERS = ("policy", "cost", "peak", "×none", "×cow", "owned", "qemu", "mgr+", "p50 s", "p95 s", "slow",
                "cpu", "cpu/w")


def rich_table(result: dict[str, Any]) -> Any:
    """The terminal table: compact (whole MiB, one-decimal ratios, no box) to fit 80 columns."""
    from rich import box
    from rich.table import Table
    validate(result)
    table = Table(title=_title(result), box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 1), collapse_padding=True,
                  caption="MiB averaged over the run (peak: max). cost: host used above idle minus QEMU's own "
                  "memory (qemu, per sandbox: set aside, TCG's translation cache here, a few tens of MiB under "
                  "KVM); ×: baseline cost / policy cost; mgr+: the manager's own (anon) memory above idle; "
                  "slow: median tool latency / none-cow's; cpu: compression CPU s (cpu/w: per compression)")
    for k, h in enumerate(RICH_HEADERS):
        table.add_column(h, justify="left" if k == 0 else "right", no_wrap=True)
    r = ratios(result)
    for name in ordered_policies(result):
        pol = result["policies"][name]

        def mib(key: str, pol: dict[str, Any] = pol) -> str:
            v = _get(pol, key)
            return "—" if v is None or not math.isfinite(v) else fmt_mib(v, 0, thousands=True, unit=False)

        def x(v: float | None) -> str:
            return "—" if v is None else f"{v:.1f}×"

        table.add_row(name, mib("host_cost_bytes_avg"), mib("host_cost_bytes_peak"),
                      x(r[name]["ratio_vs_none"]), x(r[name]["ratio_vs_none_cow"]),
                      mib("owned_bytes_avg"), mib("qemu_own_bytes_avg"), mib("manager_anon_above_idle_bytes_avg"),
                      _s(_get(pol, "tool_latency_s.median")), _s(_get(pol, "tool_latency_s.p95")),
                      x(r[name]["slowdown_vs_none_cow"]), _s(_get(pol, "compress_cpu_s_total")),
                      _cpu_wait(_get(pol, "compress_cpu_s_per_wait")))
    return table


def print_table(result: dict[str, Any], console: Any = None) -> None:
    table = rich_table(result)
    console = console or table_console(table)
    console.print(table)
    for line in spread_lines(result):
        console.print(line, highlight=False)


# ---------------------------------------------------------------------------------------
# Plots (matplotlib's Agg canvas directly: no pyplot, no global backend state)
# ---------------------------------------------------------------------------------------

def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def plot_memory(result: dict[str, Any], path: Path) -> Path | None:
    """Owned memory (all sandboxes) and host memory in use over time, one line per policy.
    None when no policy carries a series."""
    pols = [(n, result["policies"][n].get("series")) for n in ordered_policies(result)]
    pols = [(n, s) for n, s in pols if isinstance(s, dict) and s.get("t_s")]
    if not pols:
        return None
    fig = _figure(9, 6.5)
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    for name, s in pols:
        t = s["t_s"]
        if s.get("owned_bytes"):
            ax1.plot(t, [None if v is None else v / MIB for v in s["owned_bytes"]], label=name, lw=1.4)
        if s.get("host_used_bytes"):
            ax2.plot(t, [None if v is None else v / MIB for v in s["host_used_bytes"]], label=name, lw=1.4)
    ax1.set_ylabel("owned by sandboxes (MiB)")
    ax2.set_ylabel("host memory in use (MiB)")
    ax2.set_xlabel("time since start of run (s)")
    ax1.set_title(_title(result))
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
    ax1.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_latency_cdf(result: dict[str, Any], path: Path) -> Path | None:
    """Empirical CDF of tool-call latency per policy; None when no latencies were kept."""
    pols = [(n, result["policies"][n].get("tool_latencies_s")) for n in ordered_policies(result)]
    pols = [(n, sorted(v)) for n, v in pols if isinstance(v, list) and v]
    if not pols:
        return None
    fig = _figure(8, 5)
    ax = fig.subplots()
    for name, lat in pols:
        n = len(lat)
        ax.step(lat, [(k + 1) / n for k in range(n)], where="post", label=f"{name} (n={n})", lw=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("tool-call latency (s, log)")
    ax.set_ylabel("fraction of tool calls")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(_title(result))
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    return path


# ---------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------

def _json_default(o: Any) -> Any:
    # numpy scalars and arrays, which a runner may leave in the dict
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _finite(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


def to_json(result: dict[str, Any]) -> str:
    """The result as JSON: numpy values converted, NaN/inf as null (strict JSON for tools)."""
    plain = json.loads(json.dumps(result, default=_json_default))
    return json.dumps(_finite(plain), indent=1, allow_nan=False) + "\n"


@dataclass(frozen=True)
class ReportFiles:
    json: Path
    markdown: Path
    memory_png: Path | None
    latency_png: Path | None


def write_report(result: dict[str, Any], out_dir: Path, prefix: str = "density") -> ReportFiles:
    """Write PREFIX.json (the contract plus ratios), PREFIX.md, PREFIX-memory.png and
    PREFIX-latency.png (when the result carries series / latencies) into out_dir."""
    validate(result)
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / f"{prefix}.json"
    js.write_text(to_json(with_ratios(result)))
    md = out_dir / f"{prefix}.md"
    md.write_text(markdown_table(result))
    return ReportFiles(js, md, plot_memory(result, out_dir / f"{prefix}-memory.png"),
                       plot_latency_cdf(result, out_dir / f"{prefix}-latency.png"))
