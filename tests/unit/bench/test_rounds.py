"""The density benchmark in rounds: the A-B-B-A order, the merged figures (means, peaks,
pooled tool calls), the spread the report states, and the outputs compared across rounds."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
from rich.console import Console

from azqemu.bench import density as density_mod
from azqemu.bench import report, rounds
from azqemu.bench.density import PolicyRun, StepResult, outputs_identical, summarize

MIB = 1 << 20


def _run(policy: str, cost_mib: float, latencies: list[float], *, peak_mib: float | None = None,
         sha: str = "x", cpu_per_wait: float | None = None, idle_drift_mib: float = 0.0) -> PolicyRun:
    t = [0.0, 1.0, 2.0]
    cost = [cost_mib * MIB, (peak_mib or cost_mib) * MIB, cost_mib * MIB]
    series = {"t_s": t, "owned_bytes": [cost_mib * MIB / 2] * 3, "host_used_bytes": cost,
              "store_bytes": [0.0] * 3, "zram_bytes": [0.0] * 3, "manager_rss_bytes": [80.0 * MIB] * 3,
              "qemu_own_bytes": [0.0] * 3, "host_cost_bytes": cost, "manager_anon_bytes": [0.0] * 3}
    steps = [StepResult(0, k, "edit" if k % 2 else "test", 0, lat, sha) for k, lat in enumerate(latencies)]
    return PolicyRun(policy, series, steps, {"compress_cpu_s_per_wait": cpu_per_wait, "zram_algorithm": "lz4",
                                             "host_parts_bytes_avg": {"anon": cost_mib * MIB},
                                             "host_idle_drift_bytes": idle_drift_mib * MIB})


def _round(cow_mib: float, az_mib: float, cow_lat: list[float], az_lat: list[float], **az: object) -> dict:
    runs = [_run("none-cow", cow_mib, cow_lat), _run("agentzip", az_mib, az_lat, **az)]  # type: ignore[arg-type]
    return summarize(SimpleNamespace(name="w"), 2, runs, 100 * MIB)  # type: ignore[arg-type]


def test_every_other_round_runs_the_policies_in_reverse() -> None:
    pols = ["none-cow", "linux", "agentzip"]
    assert [rounds.round_order(pols, r) for r in range(3)] == [pols, pols[::-1], pols]
    # Two rounds put every policy once in each half of the run: A B C C B A.
    assert sum((rounds.round_order(pols, 0) + rounds.round_order(pols, 1)).index(p) for p in pols[:1]) == 0


def test_merged_figures_are_the_rounds_means_and_the_tool_calls_pooled() -> None:
    r1 = _round(200, 50, [1.0, 1.0], [2.0, 2.0], peak_mib=80, cpu_per_wait=0.1)
    r2 = _round(220, 40, [1.2, 1.2], [1.0, 1.0], peak_mib=60, cpu_per_wait=None)
    merged = rounds.merge([r1, r2], [["none-cow", "agentzip"], ["agentzip", "none-cow"]])
    az = merged["policies"]["agentzip"]
    # Host cost, time-weighted: series (50, 80, 50) -> 65 and (40, 60, 40) -> 50, mean 57.5; the peak is the
    # maximum of the rounds' peaks.
    assert az["host_cost_bytes_avg"] == pytest.approx(57.5 * MIB)
    assert az["host_cost_bytes_peak"] == 80 * MIB
    # Nested figures are averaged key by key, an unknown figure is left out, text kept.
    assert az["host_parts_bytes_avg"]["anon"] == pytest.approx(45 * MIB)
    assert az["compress_cpu_s_per_wait"] == pytest.approx(0.1)
    assert az["zram_algorithm"] == "lz4"
    # Latency over every tool call of both rounds: 2, 2, 1, 1 -> median 1.5.
    assert az["tool_latencies_s"] == [2.0, 2.0, 1.0, 1.0]
    assert az["tool_latency_s"]["median"] == pytest.approx(1.5)
    assert [s["round"] for s in az["steps"]] == [0, 0, 1, 1]
    assert az["tool_call_breakdown"]["calls"] == 4 and az["tool_latency_by_kind"]["test"]["calls"] == 2
    assert az["series"] == r1["policies"]["agentzip"]["series"]
    assert [rr["order"] for rr in merged["rounds"]] == [["none-cow", "agentzip"], ["agentzip", "none-cow"]]
    # The merged result is still the contract, and its ratio is taken on the means.
    report.validate(merged)
    cow_mean = (200 + 220) / 2
    assert report.ratios(merged)["agentzip"]["ratio_vs_none_cow"] == pytest.approx(cow_mean / 57.5)


def test_one_round_is_the_result_unchanged() -> None:
    r1 = _round(200, 50, [1.0], [2.0])
    assert rounds.merge([r1], [["none-cow", "agentzip"]]) is r1
    assert report.round_spread(r1) == {} and report.spread_lines(r1) == []
    with pytest.raises(ValueError):
        rounds.merge([], [])


def test_the_spread_is_each_round_on_its_own() -> None:
    r1 = _round(200, 50, [1.0], [2.0], peak_mib=50)
    r2 = _round(220, 40, [1.0], [1.5], peak_mib=40)
    merged = rounds.merge([r1, r2], [["none-cow", "agentzip"], ["agentzip", "none-cow"]])
    spread = report.round_spread(merged)["agentzip"]
    assert spread["ratio_vs_none_cow"] == pytest.approx([4.0, 5.5])
    assert spread["slowdown_vs_none_cow"] == pytest.approx([2.0, 1.5])
    assert spread["host_cost_bytes_avg"] == pytest.approx([50 * MIB, 40 * MIB])
    out = json.loads(report.to_json(report.with_ratios(merged)))
    assert out["policies"]["agentzip"]["rounds_spread"]["ratio_vs_none_cow"] == pytest.approx([4.0, 5.5])
    lines = report.spread_lines(merged)
    assert "none-cow-agentzip / agentzip-none-cow" in lines[0]
    assert any("agentzip:" in ln and "vs none-cow 4.00x-5.50x" in ln and "slowdown 1.50x-2.00x" in ln
               for ln in lines)
    md = report.markdown_table(merged)
    assert "2 rounds" in md and "- agentzip:" in md
    console = Console(record=True, width=200)
    report.print_table(merged, console)
    assert "2 rounds" in console.export_text()


def test_outputs_are_compared_across_rounds_too() -> None:
    r1 = _round(200, 50, [1.0], [2.0])
    r2 = _round(220, 40, [1.0], [1.5], sha="other")
    merged = rounds.merge([r1, r2], [["none-cow", "agentzip"], ["agentzip", "none-cow"]])
    assert outputs_identical(merged) == ["agentzip: sandbox 0 step 0 (test) in round 2 differs from none-cow"]
    assert outputs_identical(rounds.merge([r1, r1], [["none-cow", "agentzip"]] * 2)) == []


def test_unknown_in_every_round_stays_unknown() -> None:
    assert rounds._mean([None, None], "compress_cpu_s_per_wait") is None
    assert math.isnan(rounds._mean([float("nan"), float("nan")], "x"))
    assert rounds._mean([3, 5], "compressions") == 4.0


def test_the_idle_host_drift_is_stated_per_policy_and_per_round() -> None:
    one = _round(200, 50, [1.0], [2.0], idle_drift_mib=-56)
    note = report.idle_drift_note(one)
    assert "none-cow +0.0" in note and "agentzip -56.0" in note
    assert "agentzip -56.0" in report.markdown_table(one)
    two = rounds.merge([one, _round(220, 40, [1.0], [1.5], idle_drift_mib=2)],
                       [["none-cow", "agentzip"], ["agentzip", "none-cow"]])
    assert "agentzip -56.0 / +2.0" in report.idle_drift_note(two)
    # A result from before the figure existed says nothing about it.
    for pol in one["policies"].values():
        del pol["host_idle_drift_bytes"]
    assert report.idle_drift_note(one) == ""


def test_the_cli_passes_the_rounds_and_refuses_zero(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    import contextlib

    from click.testing import CliRunner

    from azqemu.bench import density
    from azqemu.cli import bench_cmds

    merged = rounds.merge([_round(200, 50, [1.0], [2.0]), _round(220, 40, [1.0], [1.5])],
                          [["none-cow", "agentzip"], ["agentzip", "none-cow"]])
    seen: list[int] = []

    def fake_density(wl: object, n: int, policies: list[str], **kw: object) -> dict:
        seen.append(kw["round_count"])  # type: ignore[arg-type]
        return merged

    monkeypatch.setattr(bench_cmds, "ensure_daemon", contextlib.nullcontext)
    monkeypatch.setattr(density, "run_density", fake_density)
    r = CliRunner().invoke(bench_cmds.bench, ["density", "-n", "2", "--policy", "none-cow", "--policy", "agentzip",
                                              "--rounds", "2", "--json", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert seen == [2]
    assert json.loads(r.stdout)["policies"]["agentzip"]["rounds_spread"]["ratio_vs_none_cow"] == pytest.approx([4.0, 5.5])
    bad = CliRunner().invoke(bench_cmds.bench, ["density", "--rounds", "0"])
    assert bad.exit_code == 2 and "--rounds" in bad.output and seen == [2]


def test_run_density_refuses_zero_rounds_before_touching_the_host() -> None:
    from azqemu.bench.workload import load
    from azqemu.errors import ConfigError

    with pytest.raises(ConfigError, match="rounds must be at least 1"):
        density_mod.run_density(load("coding-agent"), 1, ["none-cow"], round_count=0)
