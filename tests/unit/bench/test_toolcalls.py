"""Tool calls per kind and the manager's parts of them (the density benchmark's breakdown)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from azqemu.bench import report, toolcalls
from azqemu.bench.density import PolicyRun, StepResult, summarize


def _steps(latencies: dict[str, list[float]], *, faults: int = 0, lock_wait_s: float = 0.0,
           trim_paused_s: float = 0.0, faults_from_store: int = 0) -> list[StepResult]:
    return [StepResult(0, i, label, 0, lat, "x", resume_s=0.01, lock_wait_s=lock_wait_s,
                       trim_paused_s=trim_paused_s, faults=faults, faults_from_store=faults_from_store)
            for label, lats in latencies.items() for i, lat in enumerate(lats)]


def _run(policy: str, steps: list[StepResult]) -> PolicyRun:
    series = {k: [1.0, 1.0] for k in ("owned_bytes", "host_used_bytes", "store_bytes", "zram_bytes",
                                        "manager_rss_bytes", "qemu_own_bytes")}
    series["t_s"] = [0.0, 1.0]
    return PolicyRun(policy, series, steps, {})


def test_by_kind_gives_median_p95_and_the_median_of_each_part() -> None:
    rows = [s.__dict__ for s in _steps({"grep": [1.0, 2.0, 3.0], "test": [10.0]}, faults=7, lock_wait_s=0.5)]
    kinds = toolcalls.by_kind(rows)
    assert set(kinds) == {"grep", "test"}
    assert kinds["grep"]["calls"] == 3 and kinds["grep"]["median_s"] == 2.0
    assert kinds["grep"]["p95_s"] == pytest.approx(2.9)
    assert kinds["grep"]["faults_median"] == 7 and kinds["grep"]["lock_wait_s_median"] == 0.5
    assert kinds["test"]["resume_s_median"] == 0.01


def test_breakdown_sums_the_parts_and_counts_faults_per_call() -> None:
    rows = [s.__dict__ for s in _steps({"run": [1.0, 3.0]}, faults=10, trim_paused_s=0.25, faults_from_store=4)]
    b = toolcalls.breakdown(rows)
    assert b["calls"] == 2 and b["latency_s_sum"] == 4.0
    assert b["trim_paused_s_sum"] == 0.5 and b["resume_s_sum"] == pytest.approx(0.02)
    assert b["faults_per_call"] == 10.0 and b["store_faults_per_call"] == 4.0
    assert toolcalls.breakdown([])["faults_per_call"] != toolcalls.breakdown([])["faults_per_call"]  # NaN


def test_summary_carries_the_breakdown_and_the_report_prints_slowdown_per_kind() -> None:
    runs = [_run("none-cow", _steps({"grep": [1.0, 1.0], "test": [2.0]})),
            _run("agentzip", _steps({"grep": [1.5, 1.5], "test": [5.0]}, faults=40, trim_paused_s=0.1,
                                    faults_from_store=30))]
    res = summarize(SimpleNamespace(name="w"), 1, runs, 0)  # type: ignore[arg-type]
    az = res["policies"]["agentzip"]
    assert az["tool_latency_by_kind"]["test"]["median_s"] == 5.0
    assert az["tool_call_breakdown"]["faults_per_call"] == 40
    assert toolcalls.slowdown_by_kind(res, "agentzip") == {"grep": 1.5, "test": 2.5}
    note = toolcalls.markdown_note(res)
    assert "agentzip: 3 tool calls" in note and "grep 1.50x, test 2.50x" in note and "40 faults per call (30 from the store)" in note
    assert note in report.markdown_table(res)
