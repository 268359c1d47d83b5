"""Running the nightly benchmark and recording its outcome.

``run`` plays the benchmarks a planned history line names (density per workload, clone,
restore) and fills in their headline figures; ``finish`` compares them with the baselines
chosen before the run, appends the line to the history, draws the trend plots and writes
``nightly.json`` beside the run's result files.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from azqemu.bench import density, report
from azqemu.bench.clone_bench import run_clone
from azqemu.bench.nightly import (
    CLONE_PATHS,
    DENSITY_PATHS,
    HISTORY_NAME,
    METRICS,
    RESTORE_PATHS,
    Baseline,
    Comparison,
    Options,
    append_record,
    as_float,
    compare,
    fmt_value,
    plain_json,
    value_at,
)
from azqemu.bench.nightly_plot import plot_trends
from azqemu.bench.workload import Workload
from azqemu.client import Client

log = logging.getLogger(__name__)


def density_headline(result: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per policy: the figures of DENSITY_METRICS from a density result."""
    ratios = report.ratios(result)
    out = {}
    for name, pol in result["policies"].items():
        row = {k: value_at(pol, p) for k, p in DENSITY_PATHS.items()}
        for k in ("ratio_vs_none", "ratio_vs_none_cow", "slowdown_vs_none_cow"):
            row[k] = as_float(ratios[name][k])
        out[name] = row
    return out


def density_prefix(workload: str) -> str:
    """density.json for coding-agent (where `azq capacity` looks), density-<workload> else."""
    return "density" if workload == "coding-agent" else f"density-{workload}"


@dataclass
class RunOutput:
    record: dict[str, Any]
    files: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run(c: Client, record: dict[str, Any], workloads: list[Workload], opts: Options, run_dir: Path, *,
        bench_template: Callable[[], str], progress: Callable[[str], None]) -> RunOutput:
    """Run every benchmark of the planned record, filling its figures. A benchmark that fails
    (whatever the error: one broken benchmark must not cost the night's other figures) is
    recorded with its error, its traceback goes to the debug log, and the others go on; an
    interrupt ends everything and records nothing."""
    from azqemu.bench import restore_bench

    out = RunOutput(record)
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    for wl in workloads:
        entry = record["workloads"][wl.name]
        progress(f"density: {wl.name}, {opts.sandboxes} sandboxes, scale {opts.scale}")
        try:
            result = density.run_density(wl, opts.sandboxes, list(opts.policies), seed=opts.seed,
                                         scale=opts.scale, grace_s=opts.grace_s, progress=progress)
            result.update(seed=opts.seed, scale=opts.scale)
            files = report.write_report(result, run_dir, prefix=density_prefix(wl.name))
            out.files.append(str(files.json))
            entry["policies"] = density_headline(result)
        except Exception as exc:  # noqa: BLE001 - recorded; an interrupt (BaseException) ends the run
            log.error("nightly benchmark failed", exc_info=True)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            out.errors.append(f"density/{wl.name}: {entry['error']}")
    for group in ("clone", "restore"):
        entry = record[group]
        if entry is None:
            continue
        progress(f"{group} benchmark")
        try:
            template = bench_template()
            if group == "clone":
                res = run_clone(c, template, entry["count"], entry["ram_mode"], name_prefix="azq-nightly-clone-")
                paths = CLONE_PATHS
            else:
                res = restore_bench.run(c, template=template, hot_mib=entry["hot_mib"], progress=progress)
                paths = RESTORE_PATHS
            (run_dir / f"{group}.json").write_text(json.dumps(plain_json(res), indent=1) + "\n")
            out.files.append(str(run_dir / f"{group}.json"))
            entry["figures"] = {k: value_at(res, p) for k, p in paths.items()}
        except Exception as exc:  # noqa: BLE001 - recorded; an interrupt (BaseException) ends the run
            log.error("nightly benchmark failed", exc_info=True)
            entry["error"] = f"{type(exc).__name__}: {exc}"
            out.errors.append(f"{group}: {entry['error']}")
    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["run_dir"] = run_dir.name
    return out


@dataclass
class Outcome:
    history_file: Path
    run_dir: Path
    record: dict[str, Any]
    baselines: dict[str, Baseline]
    comparisons: list[Comparison]
    plots: list[Path]
    errors: list[str]
    history_warnings: list[str]
    files: list[str]

    @property
    def regressions(self) -> list[Comparison]:
        return [c for c in self.comparisons if c.verdict == "regression"]

    def as_json(self) -> dict[str, Any]:
        return plain_json({
            "history_file": str(self.history_file), "run_dir": str(self.run_dir), "record": self.record,
            "baselines": {g: b.as_json() for g, b in self.baselines.items()},
            "comparisons": [asdict(c) for c in self.comparisons],
            "regressions": [str(c) for c in self.regressions], "plots": [str(p) for p in self.plots],
            "errors": self.errors, "history_warnings": self.history_warnings, "files": self.files})


def finish(root: Path, out: RunOutput, baselines: dict[str, Baseline], *, history_warnings: list[str],
           tolerance: float | None = None, run_dir: Path | None = None) -> Outcome:
    """Compare, record the run (its line names the runs it was compared with and what
    regressed), then draw the trend plots."""
    rec = out.record
    comps = compare(rec, baselines, tolerance)
    rec["compared_with"] = {g: [r["run_id"] for r in b.runs] for g, b in baselines.items() if b.ready}
    rec["regressions"] = [c.figure for c in comps if c.verdict == "regression"]
    history = root / HISTORY_NAME
    append_record(history, rec)
    rd = run_dir or root / rec.get("run_dir", rec["run_id"])
    rd.mkdir(parents=True, exist_ok=True)
    plots = plot_trends(rd, rec, baselines, comps)
    outcome = Outcome(history, rd, rec, baselines, comps, plots, out.errors, history_warnings, out.files)
    (rd / "nightly.json").write_text(json.dumps(outcome.as_json(), indent=1, allow_nan=False) + "\n")
    return outcome


def format_comparisons(outcome: Outcome, *, all_rows: bool = False) -> str:
    """The terminal report: per group its baseline, then its figures (regressions and
    improvements always; every figure with ``all_rows``)."""
    lines = []
    for group, b in outcome.baselines.items():
        lines.append(b.describe())
        rows = [c for c in outcome.comparisons if b.ready and c.group == group and c.verdict != "no baseline"
                and (all_rows or c.verdict in ("regression", "better", "missing"))]
        for c in rows:
            m = METRICS[c.metric]
            band_txt = f"{fmt_value(c.lo, m)} .. {fmt_value(c.hi, m)}" if c.lo is not None else ""
            lines.append(f"  {c.verdict.upper() if c.verdict == 'regression' else c.verdict:<10} "
                         f"{(c.series + ' ') if c.series else ''}{c.metric:<22} {fmt_value(c.value, m):>12}"
                         f"  baseline {fmt_value(c.baseline, m):>12}  band {band_txt}")
        if b.ready and not rows:
            lines.append("  every figure inside its band")
    return "\n".join(lines)
