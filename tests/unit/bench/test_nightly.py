"""The nightly benchmark's history, comparability, noise band and verdicts (no VM)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.bench import nightly, nightly_run
from azqemu.bench.nightly import METRICS, Baseline, Options
from azqemu.bench.workload import load
from azqemu.errors import ConfigError

MIB = 1 << 20
CTX = {"commit": "v0-1-gabc", "host": "h1", "accelerator": "tcg", "kernel": "6.1.0"}


def opts(**kw: Any) -> Options:
    base: dict[str, Any] = {"workloads": ("coding-agent",), "sandboxes": 2, "scale": "small",
                            "policies": ("none-cow", "agentzip"), "clones": 2, "restore_hot_mib": 16}
    base.update(kw)
    return Options(**base)


def planned(run_id: str, o: Options | None = None, ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    o = o or opts()
    return nightly.planned_record(o, [load(w) for w in o.workloads], ctx or CTX, run_id=run_id)


def filled(run_id: str, cost_mib: float = 100.0, tool_s: float = 1.0, o: Options | None = None,
           ctx: dict[str, Any] | None = None) -> dict[str, Any]:
    """A record as a run fills it: agentzip at cost_mib, none-cow at 400 MiB."""
    rec = planned(run_id, o, ctx)
    for w in rec["workloads"].values():
        w["policies"] = {
            "none-cow": {"host_cost_bytes_avg": 400.0 * MIB, "tool_median_s": 1.0, "failed_steps": 0},
            "agentzip": {"host_cost_bytes_avg": cost_mib * MIB, "tool_median_s": tool_s, "failed_steps": 0,
                         "ratio_vs_none_cow": 4.0},
        }
    if rec["clone"]:
        rec["clone"]["figures"] = {"per_clone_median_s": 0.5, "per_clone_p95_s": 0.7, "total_s": 1.2}
    if rec["restore"]:
        rec["restore"]["figures"] = {"resume_s": 0.05, "prefetch_mib_s": 500.0, "faults_removed_fraction": 0.95}
    return rec


def verdicts(comps: list[nightly.Comparison]) -> dict[str, str]:
    return {c.figure: c.verdict for c in comps}


# -- history ---------------------------------------------------------------------------

def test_history_round_trip_and_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "nightly" / nightly.HISTORY_NAME
    assert nightly.read_history(path) == ([], [])
    a, b = filled("2026-01-01-000000"), filled("2026-01-02-000000", cost_mib=float("nan"))
    nightly.append_record(path, a)
    with path.open("ab") as f:                  # a crash in the middle of an append
        f.write(b'{"format": "azq-nightly/1", "run_id": "torn')
    nightly.append_record(path, b)
    with path.open("ab") as f:
        f.write(b'{"format": "other/9"}\n\n')
    recs, warns = nightly.read_history(path)
    assert [r["run_id"] for r in recs] == [a["run_id"], b["run_id"]]
    assert recs[0] == json.loads(json.dumps(a))
    # NaN is recorded as null (strict JSON), and the figure is then missing, not a number
    assert recs[1]["workloads"]["coding-agent"]["policies"]["agentzip"]["host_cost_bytes_avg"] is None
    assert len(warns) == 2 and "torn" in warns[0] and "not an azq-nightly/1 record" in warns[1]
    assert all(line.startswith(b"{") for line in path.read_bytes().splitlines() if line)


def test_history_skips_overlong_line(tmp_path: Path) -> None:
    path = tmp_path / nightly.HISTORY_NAME
    path.write_bytes(b"x" * (nightly.MAX_LINE_BYTES + 10) + b"\n")
    nightly.append_record(path, filled("r1"))
    recs, warns = nightly.read_history(path)
    assert [r["run_id"] for r in recs] == ["r1"] and "longer than" in warns[0]


def test_append_is_one_write_with_o_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / nightly.HISTORY_NAME
    writes: list[bytes] = []
    real_write = os.write

    def spy(fd: int, data: bytes) -> int:
        writes.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(nightly.os, "write", spy)
    nightly.append_record(path, filled("r1"))
    nightly.append_record(path, filled("r2"))
    assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)


# -- comparability -----------------------------------------------------------------------

def test_comparability_is_decided_before_running() -> None:
    hist = [filled(f"r{i}") for i in range(7)]
    hist.insert(3, filled("other-host", ctx={**CTX, "host": "h2"}))
    hist.insert(4, filled("other-scale", o=opts(scale="full")))
    hist.insert(5, filled("other-seed", o=opts(seed=1)))
    hist.insert(6, filled("kvm", ctx={**CTX, "accelerator": "kvm"}))
    hist.append(filled("other-grace", o=opts(grace_s=2.0)))
    hist.append(filled("more-sandboxes", o=opts(sandboxes=3)))
    hist.append(filled("new-commit", ctx={**CTX, "commit": "v0-9", "kernel": "6.2"}))  # comparable
    failed = filled("failed")
    failed["workloads"]["coding-agent"]["error"] = "SandboxError: boom"
    hist.append(failed)
    b = nightly.plan_baselines(hist, planned("now"), k=5)
    assert set(b) == {"density/coding-agent", "clone", "restore"}
    d = b["density/coding-agent"]
    assert [r["run_id"] for r in d.runs] == ["r3", "r4", "r5", "r6", "new-commit"]
    assert len(d.comparable) == 8 and d.ready and "median of the last 5 of 8" in d.describe()
    # clone and restore do not depend on scale, seed, grace or sandboxes: only on host and their own knobs
    assert len(b["clone"].comparable) == 13
    assert len(nightly.plan_baselines(hist, planned("now", opts(clones=4)))["clone"].comparable) == 0
    assert len(nightly.plan_baselines(hist, planned("now", opts(restore_hot_mib=8)))["restore"].comparable) == 0


def test_edited_workload_starts_a_new_series() -> None:
    hist = [filled("r1"), filled("r2")]
    for r in hist:
        r["workloads"]["coding-agent"]["digest"] = "0123456789ab"
    b = nightly.plan_baselines(hist, planned("now"))
    assert b["density/coding-agent"].comparable == [] and not b["density/coding-agent"].ready


def test_skipped_benchmarks_have_no_group() -> None:
    p = planned("now", opts(clones=None, restore_hot_mib=None))
    assert set(nightly.group_keys(p)) == {"density/coding-agent"}
    assert p["clone"] is None and p["restore"] is None


def test_k_below_two_refused() -> None:
    with pytest.raises(ConfigError, match="k must be at least 2"):
        nightly.plan_baselines([], planned("now"), k=1)


# -- band and verdicts -------------------------------------------------------------------

def test_band_uses_spread_and_floors() -> None:
    m = METRICS["tool_median_s"]                     # floor 0.05 s or 15%
    b = nightly.band([1.0, 1.0, 1.0], m)
    assert (b.median, b.spread) == (1.0, 0.0) and b.hi == pytest.approx(1.15)
    wide = nightly.band([1.0, 2.0, 3.0, 1.5, 2.5], m)   # MAD 0.5
    assert wide.spread == pytest.approx(0.5 * nightly.MAD_TO_SIGMA)
    assert wide.hi == pytest.approx(2.0 + 3 * 0.5 * nightly.MAD_TO_SIGMA)
    assert nightly.band([0.0, 0.0], m).hi == pytest.approx(0.05)
    assert nightly.band([1.0, 1.0], m, tolerance=0.5).hi == pytest.approx(1.5)


def test_compare_flags_regressions_and_improvements() -> None:
    hist = [filled(f"r{i}", cost_mib=100 + i) for i in range(5)]      # 100..104 MiB
    cur = filled("now", cost_mib=130, tool_s=0.5)
    cur["workloads"]["coding-agent"]["policies"]["agentzip"]["failed_steps"] = 2
    cur["restore"]["figures"]["prefetch_mib_s"] = 300.0               # lower is worse
    cur["clone"]["figures"]["total_s"] = None                         # missing: said, not flagged
    comps = nightly.compare(cur, nightly.plan_baselines(hist, planned("now")))
    v = verdicts(comps)
    assert v["density/coding-agent/agentzip/host_cost_bytes_avg"] == "regression"
    assert v["density/coding-agent/agentzip/failed_steps"] == "regression"
    assert v["restore/prefetch_mib_s"] == "regression"
    assert v["density/coding-agent/agentzip/tool_median_s"] == "better"
    assert v["density/coding-agent/none-cow/tool_median_s"] == "ok"
    assert v["clone/total_s"] == "missing"
    reg = next(c for c in comps if c.figure.endswith("agentzip/host_cost_bytes_avg"))
    assert reg.baseline == 102 * MIB and reg.runs == 5 and reg.change == pytest.approx(28 / 102)
    assert "130.0 MiB vs baseline 102.0 MiB" in str(reg) and "worse" in str(reg)


def test_no_baseline_is_never_a_regression() -> None:
    cur = filled("now", cost_mib=10_000, tool_s=99)
    for hist in ([], [filled("r0")]):
        comps = nightly.compare(cur, nightly.plan_baselines(hist, planned("now")))
        assert comps and {c.verdict for c in comps} == {"no baseline"}


def test_figure_without_enough_baseline_values_is_not_compared() -> None:
    hist = [filled("r0"), filled("r1")]
    del hist[0]["workloads"]["coding-agent"]["policies"]["agentzip"]["tool_median_s"]
    cur = filled("now", tool_s=50)
    v = verdicts(nightly.compare(cur, nightly.plan_baselines(hist, planned("now"))))
    assert v["density/coding-agent/agentzip/tool_median_s"] == "no baseline"
    assert v["density/coding-agent/agentzip/host_cost_bytes_avg"] == "ok"


finite = st.floats(min_value=-1e12, max_value=1e12, allow_nan=False)


@given(st.lists(finite, min_size=1, max_size=12), st.sampled_from(sorted(METRICS)))
def test_band_holds_the_median_and_is_at_least_the_floor(values: list[float], name: str) -> None:
    m = METRICS[name]
    b = nightly.band(values, m)
    assert b.lo <= b.median <= b.hi
    assert nightly.verdict(b.median, b, m) == "ok"
    # Float rounding, at the scale of the band's edge (a 32 MiB floor above a median near 0).
    assert b.hi - b.median >= m.floor_abs - 1e-9 * max(1.0, abs(b.median), abs(b.hi))


@given(st.lists(finite, min_size=2, max_size=12), finite, st.floats(min_value=0, max_value=1e12),
       st.sampled_from(sorted(METRICS)))
def test_verdict_is_monotonic(values: list[float], x: float, d: float, name: str) -> None:
    """Worse than a regression is a regression too."""
    m = METRICS[name]
    b = nightly.band(values, m)
    worse = x + d if m.worse == "higher" else x - d
    if nightly.verdict(x, b, m) == "regression":
        assert nightly.verdict(worse, b, m) == "regression"


@settings(max_examples=50)
@given(st.lists(st.tuples(st.sampled_from(["h1", "h2"]), st.sampled_from(["tcg", "kvm"]),
                          st.sampled_from([1, 2]), st.booleans()), max_size=15),
       st.integers(min_value=2, max_value=6))
def test_baseline_is_the_latest_k_comparable_runs(runs: list[tuple[str, str, int, bool]], k: int) -> None:
    hist = []
    for i, (host, accel, seed, ok) in enumerate(runs):
        r = filled(f"r{i:02}", o=opts(seed=seed), ctx={**CTX, "host": host, "accelerator": accel})
        if not ok:
            r["workloads"]["coding-agent"]["policies"] = {}
        hist.append(r)
    b = nightly.plan_baselines(hist, planned("now"), k)["density/coding-agent"]
    expect = [f"r{i:02}" for i, (h, a, s, ok) in enumerate(runs) if (h, a, s, ok) == ("h1", "tcg", 0, True)]
    assert [r["run_id"] for r in b.comparable] == expect
    assert [r["run_id"] for r in b.runs] == expect[-k:]
    cur = filled("now", cost_mib=1e6)
    if len(expect) < 2:
        assert not any(c.verdict == "regression" for c in nightly.compare(cur, {b.group: b}))


# -- the outcome ---------------------------------------------------------------------------

def test_finish_records_compares_and_plots(tmp_path: Path) -> None:
    root = tmp_path / "nightly"
    for i in range(3):
        nightly.append_record(root / nightly.HISTORY_NAME, filled(f"2026-01-0{i + 1}-000000", cost_mib=100 + i))
    hist, warns = nightly.read_history(root / nightly.HISTORY_NAME)
    o = opts(restore_hot_mib=None)
    cur = filled("2026-01-09-000000", cost_mib=150, o=o)
    baselines = nightly.plan_baselines(hist, cur)
    run_dir = root / cur["run_id"]
    outcome = nightly_run.finish(root, nightly_run.RunOutput(cur), baselines, history_warnings=warns,
                                 run_dir=run_dir)
    assert [c.figure for c in outcome.regressions] == ["density/coding-agent/agentzip/host_cost_bytes_avg"]
    recs, _ = nightly.read_history(root / nightly.HISTORY_NAME)
    assert len(recs) == 4 and recs[-1]["regressions"] == ["density/coding-agent/agentzip/host_cost_bytes_avg"]
    assert recs[-1]["compared_with"]["density/coding-agent"] == [r["run_id"] for r in hist]
    png = run_dir / "trend-density-coding-agent-host_cost_bytes_avg.png"
    assert png in outcome.plots and png.read_bytes()[:4] == b"\x89PNG"
    assert (run_dir / "trend-clone-total_s.png").exists()
    js = json.loads((run_dir / "nightly.json").read_text())
    assert js["baselines"]["density/coding-agent"] == {"comparable_runs": 3, "baseline_runs": [r["run_id"] for r in hist],
                                                      "status": "baseline"}
    assert js["regressions"] and js["record"]["run_id"] == cur["run_id"]
    text = nightly_run.format_comparisons(outcome)
    assert "REGRESSION agentzip host_cost_bytes_avg" in text and "clone: baseline = median" in text


def test_density_headline_from_a_density_result() -> None:
    from tests.unit.bench.test_report import synthetic, with_host_cost

    res = with_host_cost(synthetic())
    res["policies"]["azqemu"]["failed_steps"] = 1
    h = nightly_run.density_headline(res)
    assert set(h) == set(res["policies"])
    az = h["azqemu"]
    assert az["host_cost_bytes_avg"] == res["policies"]["azqemu"]["host_cost_bytes_avg"]
    assert az["tool_median_s"] == res["policies"]["azqemu"]["tool_latency_s"]["median"]
    assert az["ratio_vs_none_cow"] is not None and az["slowdown_vs_none_cow"] is not None
    assert az["failed_steps"] == 1 and set(az) == {m.name for m in nightly.DENSITY_METRICS}


def test_git_commit_outside_a_checkout(tmp_path: Path) -> None:
    assert nightly.git_commit(tmp_path) == "unknown"
    assert nightly.git_commit() != ""


def test_density_prefix_keeps_capacity_reading_coding_agent() -> None:
    assert nightly_run.density_prefix("coding-agent") == "density"
    assert nightly_run.density_prefix("long-tools") == "density-long-tools"


def test_existing_baseline_type_is_exported() -> None:
    b = Baseline("clone", [], [])
    assert not b.ready and b.as_json()["status"] == "no baseline yet"
