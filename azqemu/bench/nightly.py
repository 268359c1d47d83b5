"""The nightly benchmark: a history of runs, baselines from comparable runs, trend plots.

``azq bench nightly`` runs the density benchmark on each chosen workload, the clone benchmark
and the restore benchmark, and appends one JSON line per run to ``<results>/history.jsonl``:
where it ran (commit, host, accelerator, kernel), how (scale, seed, grace, sandboxes,
policies) and the headline figures (per workload and policy; clone; restore).

A figure is compared with the median of the same figure over the last ``k`` *comparable*
runs: same host, accelerator, sandboxes, scale, seed and grace, and the same workload (name
and a digest of its plan and template, so an edited workload file starts a new series); the
clone and restore figures need the same host, accelerator and their own parameters. The noise
band around that median is what those runs' spread says (the median absolute deviation as a
robust standard deviation, ``BAND_SIGMAS`` of them), never narrower than a floor per metric
(absolute and relative). A figure outside the band on its worse side is a regression; with
fewer than ``MIN_BASELINE_RUNS`` comparable earlier runs there is "no baseline yet" and
never a regression. Comparability is decided from the history before anything runs, and
every run is recorded, comparable or not.

This module holds the history, comparability and the comparison; ``nightly_run`` runs the
benchmarks and records the outcome, ``nightly_plot`` draws the trend plots.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from azqemu.bench import density
from azqemu.bench.workload import Workload, plan_to_json
from azqemu.errors import AzqemuError, ConfigError
from azqemu.sched import policy as policy_mod
from azqemu.units import MIB

log = logging.getLogger(__name__)

FORMAT = "azq-nightly/1"            # the history line's magic and version
HISTORY_NAME = "history.jsonl"
MAX_LINE_BYTES = 1 << 20             # a history line is a few KiB: anything larger is not ours
DEFAULT_K = 5
MIN_BASELINE_RUNS = 2                # fewer comparable earlier runs: no baseline, no verdict
MAD_TO_SIGMA = 1.4826                # MAD x this = standard deviation for normal noise
BAND_SIGMAS = 3.0                    # half-width of the band in robust standard deviations
NIGHTLY_POLICIES = (*density.DEFAULT_POLICIES, "agentzip-no-prefetch")
DEFAULT_CLONES = 16                  # as `azq bench clone`
DEFAULT_HOT_MIB = 100                # as `azq bench restore`


@dataclass(frozen=True)
class Metric:
    """One headline figure: which way is worse and the smallest change that counts
    (``floor_abs`` in the figure's unit, ``floor_rel`` of the baseline): run-to-run noise
    that a handful of repeats cannot show (TCG timing, a page cache that varies) stays
    below these."""

    name: str
    worse: str          # "higher" or "lower"
    floor_abs: float
    floor_rel: float
    unit: str           # bytes, s, us, x, MiB/s, n, fraction


DENSITY_METRICS = (
    # Host-level figures move with the host's page cache and the idle baseline (tens of MiB
    # between two idle measurements here): their absolute floor is wider than owned memory's.
    Metric("host_cost_bytes_avg", "higher", 16 * MIB, 0.10, "bytes"),
    Metric("host_cost_bytes_peak", "higher", 32 * MIB, 0.15, "bytes"),
    Metric("owned_bytes_avg", "higher", 2 * MIB, 0.10, "bytes"),
    Metric("manager_rss_bytes_avg", "higher", 4 * MIB, 0.10, "bytes"),
    Metric("ratio_vs_none", "lower", 0.1, 0.10, "x"),
    Metric("ratio_vs_none_cow", "lower", 0.1, 0.10, "x"),
    Metric("tool_median_s", "higher", 0.05, 0.15, "s"),
    Metric("tool_p95_s", "higher", 0.1, 0.25, "s"),
    Metric("slowdown_vs_none_cow", "higher", 0.05, 0.10, "x"),
    Metric("compress_cpu_s", "higher", 0.5, 0.20, "s"),
    Metric("failed_steps", "higher", 0.5, 0.0, "n"),
)
# figure name -> (path in the density result's policy, or in report.ratios' row)
DENSITY_PATHS = {"host_cost_bytes_avg": "host_cost_bytes_avg", "host_cost_bytes_peak": "host_cost_bytes_peak",
                 "owned_bytes_avg": "owned_bytes_avg", "manager_rss_bytes_avg": "manager_rss_bytes_avg",
                 "tool_median_s": "tool_latency_s.median", "tool_p95_s": "tool_latency_s.p95",
                 "compress_cpu_s": "compress_cpu_s_total", "failed_steps": "failed_steps"}
CLONE_METRICS = (
    Metric("per_clone_median_s", "higher", 0.05, 0.15, "s"),
    Metric("per_clone_p95_s", "higher", 0.1, 0.25, "s"),
    Metric("total_s", "higher", 0.2, 0.15, "s"),
)
CLONE_PATHS = {"per_clone_median_s": "per_clone_s.median", "per_clone_p95_s": "per_clone_s.p95",
               "total_s": "total_s"}
RESTORE_METRICS = (
    Metric("fault_service_median_us", "higher", 2.0, 0.15, "us"),
    Metric("fault_service_p99_us", "higher", 10.0, 0.30, "us"),
    Metric("fault_stall_median_us", "higher", 5.0, 0.15, "us"),
    Metric("prefetch_mib_s", "lower", 50.0, 0.25, "MiB/s"),   # -22% seen between two idle runs
    Metric("resume_s", "higher", 0.01, 0.20, "s"),
    Metric("faults_removed_fraction", "lower", 0.02, 0.0, "fraction"),
)
RESTORE_PATHS = {"fault_service_median_us": "fault_service_us.median", "fault_service_p99_us": "fault_service_us.p99",
                 "fault_stall_median_us": "fault_stall_us.median", "prefetch_mib_s": "prefetch_mib_s",
                 "resume_s": "resume_s", "faults_removed_fraction": "faults_removed_fraction"}
METRICS = {m.name: m for m in (*DENSITY_METRICS, *CLONE_METRICS, *RESTORE_METRICS)}
# What makes two runs' figures comparable, beyond the group itself.
HOST_KEYS = ("host", "accelerator")
DENSITY_KEYS = ("sandboxes", "scale", "seed", "grace_s")


@dataclass(frozen=True)
class Options:
    workloads: tuple[str, ...]
    sandboxes: int
    scale: str = "full"
    seed: int = 0
    grace_s: float = policy_mod.DEFAULT_GRACE_S
    policies: tuple[str, ...] = NIGHTLY_POLICIES
    clones: int | None = DEFAULT_CLONES          # None: clone benchmark skipped
    clone_mode: str = "auto"
    restore_hot_mib: int | None = DEFAULT_HOT_MIB  # None: restore benchmark skipped
    k: int = DEFAULT_K
    tolerance: float | None = None               # overrides every metric's floor_rel


# ---------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------

def as_float(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def value_at(d: Any, path: str) -> float | None:
    for part in path.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return as_float(d)


def plain_json(o: Any) -> Any:
    """Plain JSON: numpy values converted, NaN/inf as null."""
    if isinstance(o, dict):
        return {str(k): plain_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [plain_json(v) for v in o]
    if isinstance(o, (np.integer, np.floating, float)) and not isinstance(o, bool):
        return as_float(o) if isinstance(o, (float, np.floating)) else int(o)
    return o


def run_id_now() -> str:
    return time.strftime("%Y-%m-%d-%H%M%S", time.gmtime())


# ---------------------------------------------------------------------------------------
# Where the run happens (recorded in every line; host and accelerator decide comparability)
# ---------------------------------------------------------------------------------------

def git_commit(checkout: Path | None = None) -> str:
    """``git describe`` of the checkout azqemu is installed from, else "unknown"."""
    src = checkout or Path(__file__).resolve().parents[2]
    if not (src / ".git").exists():
        return "unknown"
    try:
        r = subprocess.run(["git", "-c", f"safe.directory={src}", "-C", str(src), "describe", "--always",
                            "--dirty", "--tags"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (r.stdout.strip() or "unknown") if r.returncode == 0 else "unknown"


def accelerator() -> str:
    """kvm or tcg, as templates are made here (the host facts the daemon uses)."""
    from azqemu.host import setup as hostsetup
    from azqemu.image import find_image

    try:
        kernel: Path | None = find_image().kernel
    except (AzqemuError, OSError):
        kernel = None
    try:
        return hostsetup.detect(kernel).accel
    except (AzqemuError, OSError) as exc:
        log.warning("cannot tell the accelerator: %s", exc)
        return "unknown"


def host_context() -> dict[str, Any]:
    return {"commit": git_commit(), "host": socket.gethostname(), "accelerator": accelerator(),
            "kernel": os.uname().release}


def workload_digest(wl: Workload, opts: Options) -> str:
    """What the workload makes the sandboxes do at this size, scale and seed."""
    t = wl.template
    doc = {"name": wl.name, "template": [t.image, t.mem_mib, t.vcpus, list(t.warmup)],
           "plan": plan_to_json(wl.plan(opts.sandboxes, opts.seed, opts.scale))}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]


def planned_record(opts: Options, workloads: list[Workload], ctx: dict[str, Any],
                   run_id: str | None = None) -> dict[str, Any]:
    """The history line of this run before it runs: every key comparability reads."""
    return {
        "format": FORMAT, "run_id": run_id or run_id_now(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **ctx,
        "scale": opts.scale, "seed": opts.seed, "grace_s": float(opts.grace_s), "sandboxes": opts.sandboxes,
        "policies": list(opts.policies),
        "workloads": {wl.name: {"digest": workload_digest(wl, opts), "policies": {}, "error": None}
                      for wl in workloads},
        "clone": None if opts.clones is None else {"count": opts.clones, "ram_mode": opts.clone_mode,
                                                    "figures": {}, "error": None},
        "restore": None if opts.restore_hot_mib is None else {"hot_mib": opts.restore_hot_mib,
                                                              "figures": {}, "error": None},
    }


# ---------------------------------------------------------------------------------------
# History: one JSON line per run
# ---------------------------------------------------------------------------------------

def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one line with a single O_APPEND write, then fsync: concurrent writers never
    interleave, and a crash leaves at most a torn last line, which the reader skips."""
    data = (json.dumps(plain_json(record), sort_keys=True, allow_nan=False, separators=(",", ":")) + "\n").encode()
    if len(data) > MAX_LINE_BYTES:
        raise ConfigError(f"nightly history line of {len(data)} bytes is over {MAX_LINE_BYTES}")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        # A torn last line must not swallow this one: start on a line of our own.
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data
        if os.write(fd, data) != len(data):
            raise OSError(f"short write appending to {path}")
        os.fsync(fd)
    finally:
        os.close(fd)


def read_history(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records in file order, and a warning per line that was skipped (torn, not JSON,
    another format, too long). A missing file is an empty history."""
    records: list[dict[str, Any]] = []
    warnings: list[str] = []
    try:
        f = path.open("rb")
    except FileNotFoundError:
        return records, warnings
    with f:
        n = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            n += 1
            if len(raw) > MAX_LINE_BYTES:
                warnings.append(f"{path}:{n}: line longer than {MAX_LINE_BYTES} bytes, skipped")
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(MAX_LINE_BYTES + 1)
                continue
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except ValueError:
                warnings.append(f"{path}:{n}: not a JSON line (torn write?), skipped")
                continue
            if not isinstance(rec, dict) or rec.get("format") != FORMAT:
                warnings.append(f"{path}:{n}: not an {FORMAT} record, skipped")
                continue
            records.append(rec)
    return records, warnings


# ---------------------------------------------------------------------------------------
# Comparability and baselines
# ---------------------------------------------------------------------------------------

def group_keys(rec: dict[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Group name -> what another run's group must equal to be comparable. Groups:
    ``density/<workload>``, ``clone``, ``restore`` (those the record ran or plans to)."""
    host = tuple(rec.get(k) for k in HOST_KEYS)
    out: dict[str, tuple[Any, ...]] = {}
    for wl, w in (rec.get("workloads") or {}).items():
        if isinstance(w, dict):
            out[f"density/{wl}"] = (*host, *(rec.get(k) for k in DENSITY_KEYS), wl, w.get("digest"))
    if isinstance(rec.get("clone"), dict):
        out["clone"] = (*host, rec["clone"].get("count"), rec["clone"].get("ram_mode"))
    if isinstance(rec.get("restore"), dict):
        out["restore"] = (*host, rec["restore"].get("hot_mib"))
    return out


def _group_entry(rec: dict[str, Any], group: str) -> dict[str, Any] | None:
    if group.startswith("density/"):
        e = (rec.get("workloads") or {}).get(group.removeprefix("density/"))
    else:
        e = rec.get(group)
    return e if isinstance(e, dict) else None


def group_ran(rec: dict[str, Any], group: str) -> bool:
    """The group ran to the end in this record (a failed run is no baseline)."""
    e = _group_entry(rec, group)
    return e is not None and not e.get("error") and bool(e.get("policies") or e.get("figures"))


@dataclass(frozen=True)
class Baseline:
    group: str
    runs: list[dict[str, Any]]          # the last k comparable earlier runs, oldest first
    comparable: list[dict[str, Any]]    # every comparable earlier run (for the trend plots)

    @property
    def ready(self) -> bool:
        return len(self.runs) >= MIN_BASELINE_RUNS

    def describe(self) -> str:
        n = len(self.comparable)
        if self.ready:
            return (f"{self.group}: baseline = median of the last {len(self.runs)} of {n} comparable "
                    f"runs ({self.runs[0]['run_id']} .. {self.runs[-1]['run_id']})")
        return (f"{self.group}: no baseline yet ({n} comparable earlier run{'s' if n != 1 else ''}, "
                f"{MIN_BASELINE_RUNS} needed): recorded, not compared")

    def as_json(self) -> dict[str, Any]:
        return {"comparable_runs": len(self.comparable), "baseline_runs": [r["run_id"] for r in self.runs],
                "status": "baseline" if self.ready else "no baseline yet"}


def plan_baselines(history: list[dict[str, Any]], planned: dict[str, Any], k: int = DEFAULT_K) -> dict[str, Baseline]:
    """For each group the planned run will measure: its comparable earlier runs (same key,
    ran to the end), read before anything runs."""
    if k < MIN_BASELINE_RUNS:
        raise ConfigError(f"k must be at least {MIN_BASELINE_RUNS}, not {k}")
    out = {}
    for group, key in group_keys(planned).items():
        comp = [r for r in history if group_keys(r).get(group) == key and group_ran(r, group)]
        out[group] = Baseline(group, comp[-k:], comp)
    return out


# ---------------------------------------------------------------------------------------
# Figures, bands, verdicts
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Figure:
    id: str            # density/<workload>/<policy>/<metric>, clone/<metric>, restore/<metric>
    group: str
    series: str        # the policy for density figures, "" otherwise
    metric: str
    value: float | None


def figures(rec: dict[str, Any]) -> list[Figure]:
    out = []
    for wl, w in (rec.get("workloads") or {}).items():
        pols = w.get("policies") if isinstance(w, dict) else None
        for pol, vals in (pols.items() if isinstance(pols, dict) else ()):
            if not isinstance(vals, dict):
                continue
            for m in DENSITY_METRICS:
                out.append(Figure(f"density/{wl}/{pol}/{m.name}", f"density/{wl}", pol, m.name,
                                  as_float(vals.get(m.name))))
    for group, metrics in (("clone", CLONE_METRICS), ("restore", RESTORE_METRICS)):
        entry = rec.get(group)
        vals = entry.get("figures") if isinstance(entry, dict) else None
        if not isinstance(vals, dict):
            continue
        out += [Figure(f"{group}/{m.name}", group, "", m.name, as_float(vals.get(m.name))) for m in metrics if vals]
    return out


def figure_value(rec: dict[str, Any], fig_id: str) -> float | None:
    return next((f.value for f in figures(rec) if f.id == fig_id), None)


@dataclass(frozen=True)
class Band:
    median: float
    spread: float      # robust standard deviation of the baseline runs (MAD x 1.4826)
    lo: float
    hi: float


def band(values: Iterable[float], metric: Metric, tolerance: float | None = None) -> Band:
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("a band needs at least one value")
    med = statistics.median(vals)
    sigma = MAD_TO_SIGMA * statistics.median(abs(v - med) for v in vals)
    rel = metric.floor_rel if tolerance is None else tolerance
    half = max(BAND_SIGMAS * sigma, metric.floor_abs, rel * abs(med))
    return Band(med, sigma, med - half, med + half)


def verdict(value: float, b: Band, metric: Metric) -> str:
    """regression, better or ok: outside the band on the worse side, the better side, inside."""
    worse_high = metric.worse == "higher"
    if value > b.hi:
        return "regression" if worse_high else "better"
    if value < b.lo:
        return "better" if worse_high else "regression"
    return "ok"


@dataclass(frozen=True)
class Comparison:
    figure: str
    group: str
    series: str
    metric: str
    value: float | None
    verdict: str                 # regression | better | ok | no baseline | missing
    runs: int = 0                # baseline runs that carry this figure
    baseline: float | None = None
    lo: float | None = None
    hi: float | None = None
    spread: float | None = None
    change: float | None = None  # (value - baseline) / |baseline|, signed so that > 0 is worse

    def __str__(self) -> str:
        m = METRICS[self.metric]
        what = f"{self.group}/{self.series + ' ' if self.series else ''}{self.metric}"
        if self.verdict in ("no baseline", "missing") or self.baseline is None or self.value is None:
            return f"{what}: {self.verdict}"
        ch = f" ({self.change:+.0%} worse)" if self.change is not None else ""
        return (f"{what} {fmt_value(self.value, m)} vs baseline {fmt_value(self.baseline, m)} "
                f"[band {fmt_value(self.lo, m)}..{fmt_value(self.hi, m)}]{ch}")


def compare(record: dict[str, Any], baselines: dict[str, Baseline],
            tolerance: float | None = None) -> list[Comparison]:
    """Every figure of this run against its baseline (no baseline yet: said, never flagged)."""
    out = []
    for f in figures(record):
        b = baselines.get(f.group)
        vals = [v for v in (figure_value(r, f.id) for r in (b.runs if b else [])) if v is not None]
        if f.value is None:
            # Absent now though the baseline has it: said, not flagged (a policy left out of
            # this run has no figures at all; a failed step shows in failed_steps).
            out.append(Comparison(f.id, f.group, f.series, f.metric, None,
                                  "missing" if b is not None and b.ready and vals else "no baseline", len(vals)))
            continue
        if b is None or not b.ready or len(vals) < MIN_BASELINE_RUNS:
            out.append(Comparison(f.id, f.group, f.series, f.metric, f.value, "no baseline", len(vals)))
            continue
        m = METRICS[f.metric]
        bd = band(vals, m, tolerance)
        sign = 1.0 if m.worse == "higher" else -1.0
        change = sign * (f.value - bd.median) / abs(bd.median) if bd.median else None
        out.append(Comparison(f.id, f.group, f.series, f.metric, f.value, verdict(f.value, bd, m), len(vals),
                              bd.median, bd.lo, bd.hi, bd.spread, change))
    return out


def fmt_value(v: float | None, m: Metric) -> str:
    if v is None:
        return "—"
    if m.unit == "bytes":
        return f"{v / MIB:.1f} MiB"
    if m.unit == "n":
        return f"{v:g}"
    if m.unit == "fraction":
        return f"{v * 100:.1f}%"
    if m.unit == "x":
        return f"{v:.2f}x"
    return f"{v:.3g} {m.unit}" if abs(v) < 1000 else f"{v:,.0f} {m.unit}"
