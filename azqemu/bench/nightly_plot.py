"""Trend plots of the nightly benchmark: each figure over the comparable runs, its band, this run.

One PNG per group and metric (``trend-<group>-<metric>.png`` in the run directory), one panel
per policy for the density figures. Only comparable runs are drawn (the same ones the
baseline is taken from, up to ``PLOT_MAX_RUNS``): a line through runs on another host or at
another scale would show a step that is no drift.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from azqemu.bench.nightly import (
    CLONE_METRICS,
    DENSITY_METRICS,
    RESTORE_METRICS,
    Baseline,
    Comparison,
    Metric,
    figure_value,
    group_ran,
)
from azqemu.units import MIB

PLOT_MAX_RUNS = 30                   # earlier comparable runs drawn in a trend plot


# matplotlib's Agg canvas directly, as report.py: no pyplot, no global backend state
def _figure(width: float, height: float) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure
    fig = MplFigure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _scale(m: Metric) -> tuple[float, str]:
    return (MIB, "MiB") if m.unit == "bytes" else (1.0, m.unit)


def plot_trend(path: Path, title: str, metric: Metric, series: list[str], group: str,
               history: list[dict[str, Any]], record: dict[str, Any],
               comparisons: dict[str, Comparison]) -> Path:
    """One figure over the comparable runs and this one (x: runs, oldest first), one panel
    per series (policy), the band shaded, this run marked (red when a regression)."""
    runs = [*history[-PLOT_MAX_RUNS:], record]
    div, unit = _scale(metric)
    fig = _figure(8, 1.2 + 1.9 * len(series))
    axes = fig.subplots(len(series), 1, sharex=True, squeeze=False)[:, 0]
    xs = list(range(len(runs)))
    for ax, s in zip(axes, series):
        fid = f"{group}/{s}/{metric.name}" if s else f"{group}/{metric.name}"
        ys = [figure_value(r, fid) for r in runs]
        ax.plot(xs[:-1], [None if y is None else y / div for y in ys[:-1]], "o-", color="tab:blue", lw=1.2, ms=3)
        cmp_ = comparisons.get(fid)
        if cmp_ is not None and cmp_.lo is not None and cmp_.hi is not None and cmp_.baseline is not None:
            # Over the runs the baseline was taken from, up to this run.
            x0, x1 = max(0, len(runs) - 1 - cmp_.runs) - 0.3, xs[-1] + 0.3
            ax.fill_between([x0, x1], cmp_.lo / div, cmp_.hi / div, color="tab:green", alpha=0.18,
                            label="noise band", lw=0)
            ax.plot([x0, x1], [cmp_.baseline / div] * 2, color="tab:green", lw=1, ls="--", label="baseline")
        if ys[-1] is not None:
            bad = cmp_ is not None and cmp_.verdict == "regression"
            ax.plot([xs[-1]], [ys[-1] / div], marker="X" if bad else "*", ms=12, ls="",
                    color="tab:red" if bad else "black", label="this run" + (" (regression)" if bad else ""))
        ax.set_ylabel(f"{s or metric.name} ({unit})", fontsize="small")
        ax.grid(alpha=0.3)
    axes[0].set_title(title, fontsize="medium")
    labelled = [ax for ax in axes if ax.get_legend_handles_labels()[1]]
    if labelled:
        labelled[0].legend(loc="best", fontsize="x-small")
    axes[-1].set_xticks(xs, [r.get("run_id", "?")[5:] for r in runs], rotation=60, fontsize="x-small")
    axes[-1].set_xlabel("run (comparable runs only, oldest first)")
    fig.tight_layout()
    fig.savefig(path)
    return path


def plot_trends(run_dir: Path, record: dict[str, Any], baselines: dict[str, Baseline],
                comps: list[Comparison]) -> list[Path]:
    """trend-<group>-<metric>.png in the run directory, for each group that ran."""
    by_id = {c.figure: c for c in comps}
    paths = []
    for group, b in baselines.items():
        if not group_ran(record, group):
            continue
        if group.startswith("density/"):
            metrics: tuple[Metric, ...] = DENSITY_METRICS
            series = list(record["workloads"][group.removeprefix("density/")]["policies"])
        else:
            metrics, series = (CLONE_METRICS if group == "clone" else RESTORE_METRICS), [""]
        slug = group.replace("/", "-")
        for m in metrics:
            title = f"{group}: {m.name} ({m.worse} is worse)\n{b.describe().split(': ', 1)[1].split(' (')[0]}"
            paths.append(plot_trend(run_dir / f"trend-{slug}-{m.name}.png", title, m, series, group,
                                    b.comparable, record, by_id))
    return paths

