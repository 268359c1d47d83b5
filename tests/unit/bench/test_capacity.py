"""The capacity sweep's fit and counts, on synthetic density results (no VM)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from azqemu.bench import capacity
from azqemu.errors import ConfigError
from azqemu.units import GIB, MIB

# policy -> (fixed, marginal, QEMU's own per sandbox), bytes
TRUTH = {
    "none-cow": (40 * MIB, 60 * MIB, 100 * MIB),
    "linux": (70 * MIB, 30 * MIB, 100 * MIB),
    "agentzip": (120 * MIB, 10 * MIB, 100 * MIB),
}


def _pol(fixed: float, marginal: float, qemu: float, n: int, *, with_cost: bool, noise: float = 0.0) -> dict[str, Any]:
    cost = fixed + marginal * n + noise
    pol: dict[str, Any] = {
        "owned_bytes_avg": marginal * n, "owned_bytes_peak": marginal * n * 1.5,
        "host_used_bytes_avg": cost + qemu * n, "qemu_own_bytes_avg": qemu,
        "tool_latency_s": {"median": 0.5 + n / 100, "p95": 2.0}, "compress_s_total": 0.0,
        "restore_s_total": 0.0, "failed_steps": 0, "manager_rss_bytes_avg": 50 * MIB + n * MIB,
    }
    if with_cost:
        pol["host_cost_bytes_avg"] = cost
    return pol


def _densities(fanouts: list[int], *, with_cost: bool = True, noise: dict[int, float] | None = None) -> dict[int, Any]:
    return {n: {"workload": "w", "sandboxes": n,
                "policies": {p: _pol(*TRUTH[p], n, with_cost=with_cost, noise=(noise or {}).get(n, 0.0))
                             for p in TRUTH}}
            for n in fanouts}


@pytest.mark.parametrize("with_cost", [True, False])
def test_exact_lines_are_recovered_and_counted(with_cost: bool) -> None:
    budget = 8 * GIB
    r = capacity.summarize("w", budget, _densities([4, 8, 16], with_cost=with_cost))
    assert r["workload"] == "w" and r["budget_bytes"] == budget and r["fanouts"] == [4, 8, 16]
    for name, (fixed, marginal, qemu) in TRUTH.items():
        pol = r["policies"][name]
        assert pol["marginal_host_cost_bytes"] == pytest.approx(marginal, rel=1e-9)
        assert pol["fixed_host_cost_bytes"] == pytest.approx(fixed, rel=1e-6)
        assert pol["fit_host_cost"] == math.floor((budget - fixed) / marginal)
        assert pol["fit_with_qemu"] == math.floor((budget - fixed) / (marginal + qemu))
        assert pol["qemu_own_bytes_per_sandbox"] == pytest.approx(qemu)
        assert pol["fit_r2"] == pytest.approx(1.0)
        assert pol["marginal_owned_bytes"] == pytest.approx(marginal)
        # owned + manager (the synthetic manager grows 1 MiB per sandbox above a 50 MiB idle)
        assert pol["marginal_accounted_bytes"] == pytest.approx(marginal + MIB)
        assert pol["fixed_accounted_bytes"] == pytest.approx(50 * MIB)
        assert pol["fit_accounted"] == math.floor((budget - 50 * MIB) / (marginal + MIB))
        assert pol["tool_latency_median_s"] == {"4": 0.54, "8": 0.58, "16": 0.66}
        assert pol["host_cost_source"] == (["measured"] if with_cost else ["derived"])
        assert isinstance(pol["fit_host_cost"], int) and isinstance(pol["fit_with_qemu"], int)
    # The hand-checked figures: (8192 - 120) / 10 and (8192 - 120) / 110 for agentzip.
    assert r["policies"]["agentzip"]["fit_host_cost"] == 807
    assert r["policies"]["agentzip"]["fit_with_qemu"] == 73
    assert r["policies"]["none-cow"]["fit_host_cost"] == 135


def test_least_squares_on_noisy_points() -> None:
    noise = {2: 3 * MIB, 4: -5 * MIB, 8: 4 * MIB, 16: -1 * MIB}
    r = capacity.summarize("w", GIB, _densities([2, 4, 8, 16], noise=noise))
    ns = [2, 4, 8, 16]
    fixed, marginal, _ = TRUTH["linux"]
    ys = [fixed + marginal * n + noise[n] for n in ns]
    mx, my = sum(ns) / 4, sum(ys) / 4
    slope = sum((x - mx) * (y - my) for x, y in zip(ns, ys)) / sum((x - mx) ** 2 for x in ns)
    pol = r["policies"]["linux"]
    assert pol["marginal_host_cost_bytes"] == pytest.approx(slope)
    assert pol["fixed_host_cost_bytes"] == pytest.approx(my - slope * mx)
    assert 0.9 < pol["fit_r2"] < 1.0


def test_a_fit_that_says_nothing_is_null() -> None:
    d = _densities([4, 8])
    # Host cost falling with the fan-out (noise on a tiny workload): no capacity figure.
    d[8]["policies"]["linux"]["host_cost_bytes_avg"] = d[4]["policies"]["linux"]["host_cost_bytes_avg"] - MIB
    # A policy measured at one fan-out only: no line.
    d[8]["policies"].pop("agentzip")
    r = capacity.summarize("w", GIB, d)
    lin = r["policies"]["linux"]
    assert lin["marginal_host_cost_bytes"] < 0 and lin["fit_host_cost"] is None and lin["fit_with_qemu"] is None
    az = r["policies"]["agentzip"]
    assert az["marginal_host_cost_bytes"] is None and az["fit_host_cost"] is None
    w = capacity.warnings(r)
    assert any(x.startswith("linux: host cost does not grow") for x in w)
    assert "agentzip: no fit (fewer than two fan-outs measured)" in w
    assert not any(x.startswith("none-cow") for x in w)
    assert az["tool_latency_median_s"] == {"4": pytest.approx(0.54)}
    capacity.validate(r)
    # Strict JSON: NaN never leaks, None stays null.
    text = capacity.to_json(r)
    assert json.loads(text)["policies"]["agentzip"]["fit_host_cost"] is None


def test_a_nan_point_is_left_out_of_the_fit() -> None:
    d = _densities([2, 4, 8])
    d[4]["policies"]["none-cow"]["host_cost_bytes_avg"] = float("nan")
    d[4]["policies"]["none-cow"]["host_used_bytes_avg"] = float("nan")
    pol = capacity.summarize("w", GIB, d)["policies"]["none-cow"]
    assert pol["marginal_host_cost_bytes"] == pytest.approx(TRUTH["none-cow"][1])


def test_growth_the_manager_keeps_lands_in_fixed_not_in_the_slope() -> None:
    """A one-time growth of the manager during agentzip's first run (a first compression's
    warm-up) stays: later runs' idle baselines hold it. Not carried, it shows in agentzip's
    first point alone and tilts its line (here by 14 MiB over 12 sandboxes); carried, it is in
    agentzip's fixed part, and in no other policy's figures."""
    idle, warm = 50 * MIB, 14 * MIB
    d = _densities([4, 8, 16])
    assert list(d[4]["policies"]) == ["none-cow", "linux", "agentzip"]       # the order they ran in
    for n in (4, 8, 16):
        base = idle if n == 4 else idle + warm
        d[n]["manager_idle"] = {"anon_bytes": base, "rss_bytes": 0}
        d[n]["manager_after"] = {"anon_bytes": idle + warm, "rss_bytes": 0}
        for p, pol in d[n]["policies"].items():
            pol["manager_anon_at_start_bytes"] = base
            pol["manager_anon_bytes_avg"] = base + (warm if (n, p) == (4, "agentzip") else 0)
        if n == 4:
            d[n]["policies"]["agentzip"]["host_cost_bytes_avg"] += warm
    assert capacity.growth_left_bytes(d[4]) == {"none-cow": 0.0, "linux": 0.0, "agentzip": warm}
    assert capacity.growth_left_bytes(d[8]) == dict.fromkeys(TRUTH, 0.0)
    raw = [capacity.point_of(d[n]["policies"]["agentzip"], n) for n in (4, 8, 16)]
    tilted = capacity.fit_line([4, 8, 16], [p.host_cost_bytes for p in raw])
    assert tilted is not None and tilted.marginal_bytes < TRUTH["agentzip"][1] - 0.9 * MIB
    r = capacity.summarize("w", 8 * GIB, d)
    for name, (fixed, marginal, _q) in TRUTH.items():
        pol = r["policies"][name]
        mine = warm if name == "agentzip" else 0.0
        assert pol["marginal_host_cost_bytes"] == pytest.approx(marginal, rel=1e-6)
        assert pol["fixed_host_cost_bytes"] == pytest.approx(fixed + mine, rel=1e-6)
        assert {p["sandboxes"]: p["manager_carried_bytes"] for p in pol["points"]} == {4: 0.0, 8: mine, 16: mine}
        # The manager's part: measured in the run that grew it, carried in the later ones.
        assert {p["sandboxes"]: p["manager_bytes"] for p in pol["points"]} == {4: mine, 8: mine, 16: mine}
    # Results merged from rounds (the order changes) or without the manager's figures carry nothing.
    d[4]["rounds"] = [{"order": ["none-cow", "linux", "agentzip"]}, {"order": ["agentzip", "linux", "none-cow"]}]
    assert capacity.growth_left_bytes(d[4]) == {}
    plain = capacity.summarize("w", 8 * GIB, _densities([4, 8, 16]))
    assert all(p["manager_carried_bytes"] == 0.0 for pol in plain["policies"].values() for p in pol["points"])


def test_budget_smaller_than_fixed_fits_nothing() -> None:
    r = capacity.summarize("w", 100 * MIB, _densities([4, 8]))
    assert r["policies"]["agentzip"]["fit_host_cost"] == 0


def test_sandboxes_that_fit() -> None:
    assert capacity.sandboxes_that_fit(1000, 100, 90) == 10
    assert capacity.sandboxes_that_fit(1000, 100, 0) is None
    assert capacity.sandboxes_that_fit(1000, float("nan"), 10) is None


def test_parse_fanouts_and_budget() -> None:
    assert capacity.parse_fanouts("16, 4,8,4") == [4, 8, 16]
    for bad in ("4", "4,4", "a,b", "0,4", "4,5000"):
        with pytest.raises(ConfigError, match="^fan-outs: "):
            capacity.parse_fanouts(bad)
    assert capacity.parse_budget("auto") is None and capacity.parse_budget(None) is None
    assert capacity.parse_budget("1024") == 1024
    assert capacity.parse_budget("16G") == 16 * GIB
    assert capacity.parse_budget("512MiB") == 512 * MIB
    assert capacity.parse_budget("1.5g") == 3 * GIB // 2
    for bad in ("lots", "-1G", "0"):
        with pytest.raises(ConfigError, match="^budget: "):
            capacity.parse_budget(bad)


def test_run_capacity_runs_each_fanout_once_smallest_first(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[tuple[int, list[str], dict[str, Any]]] = []
    dens = _densities([2, 4, 8])

    def runner(wl: Any, n: int, policies: list[str], **kw: Any) -> dict[str, Any]:
        calls.append((n, policies, kw))
        return dens[n]

    monkeypatch.setattr(capacity, "mem_available_bytes", lambda: 4 * GIB)
    seen: list[int] = []
    r = capacity.run_capacity(SimpleNamespace(name="w"), [8, 2, 4], ["none-cow", "agentzip"], scale="small",
                              grace_s=0.5, runner=runner, on_density=lambda n, _r: seen.append(n))
    assert [c[0] for c in calls] == [2, 4, 8] == seen
    assert calls[0][1] == ["none-cow", "agentzip"]
    assert calls[0][2]["scale"] == "small" and calls[0][2]["grace_s"] == 0.5
    assert r["budget_bytes"] == 4 * GIB and r["budget_source"] == "MemAvailable at start"
    assert r["fanouts"] == [2, 4, 8]
    files = capacity.write_report(r, tmp_path)
    data = json.loads(files.json.read_text())
    assert set(data) >= {"workload", "budget_bytes", "fanouts", "policies"}
    assert set(data["policies"]["agentzip"]) >= {"marginal_host_cost_bytes", "fixed_host_cost_bytes",
                                                 "fit_host_cost", "fit_with_qemu", "tool_latency_median_s"}
    assert files.png is not None and files.png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| agentzip |" in files.markdown.read_text()


def test_table_has_a_row_per_policy_in_order() -> None:
    r = capacity.summarize("w", 8 * GIB, _densities([4, 8]))
    headers, rows = capacity.table_rows(r)
    assert [row[0] for row in rows] == ["none-cow", "linux", "agentzip"]
    assert headers[-2:] == ["p50 s@4", "p50 s@8"]
    az = rows[2]
    assert az[1] == "120" and az[2] == "10" and az[4] == "807"
    fit, per = capacity.rich_tables(r)
    assert fit.row_count == 3 and per.row_count == 2


def test_validate_names_the_missing_key() -> None:
    r = capacity.summarize("w", GIB, _densities([4, 8]))
    del r["policies"]["linux"]["fit_with_qemu"]
    with pytest.raises(ConfigError, match=r"^capacity result: policies.linux has no 'fit_with_qemu'$"):
        capacity.validate(r)


def test_cli_writes_every_density_run_and_prints_the_contract(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import contextlib

    from click.testing import CliRunner

    from azqemu.bench import density
    from azqemu.cli import bench_cmds

    dens = _densities([1, 2])
    seen: list[tuple[int, list[str], str]] = []

    def fake_density(wl: Any, n: int, policies: list[str], **kw: Any) -> dict[str, Any]:
        seen.append((n, policies, kw["scale"]))
        d = dict(dens[n], workload=wl.name)
        d["policies"] = {p: d["policies"][p] for p in policies}
        return d

    monkeypatch.setattr(bench_cmds, "ensure_daemon", contextlib.nullcontext)
    monkeypatch.setattr(density, "run_density", fake_density)
    r = CliRunner().invoke(bench_cmds.bench, ["capacity", "--workload", "coding-agent", "--fanouts", "2,1",
                                              "--scale", "small", "--policy", "none-cow", "--policy", "agentzip",
                                              "--budget", "8G", "--json", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert seen == [(1, ["none-cow", "agentzip"], "small"), (2, ["none-cow", "agentzip"], "small")]
    out = json.loads(r.stdout)
    assert out["workload"] == "coding-agent" and out["budget_bytes"] == 8 * GIB and out["fanouts"] == [1, 2]
    assert out["policies"]["agentzip"]["fit_host_cost"] == 807
    for f in ("capacity.json", "capacity.md", "capacity.png", "density-n1.json", "density-n2.json"):
        assert (tmp_path / f).exists(), f


def test_refit_from_an_earlier_sweep(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from azqemu.bench import report

    dens = _densities([2, 4, 8])
    for n, d in dens.items():
        report.write_report(d, tmp_path, prefix=f"density-n{n}")
    (tmp_path / "density-notes.json").write_text("{}")        # not a density-nN.json: ignored
    monkeypatch.setattr(capacity, "mem_available_bytes", lambda: 2 * GIB)
    r = capacity.refit(tmp_path)
    assert r["fanouts"] == [2, 4, 8] and r["budget_bytes"] == 2 * GIB and r["budget_source"] == "MemAvailable now"
    assert r["policies"]["agentzip"]["marginal_host_cost_bytes"] == pytest.approx(10 * MIB)
    # The budget of the sweep that wrote the directory, unless one is given.
    capacity.write_report(dict(capacity.summarize("w", 8 * GIB, dens), scale="small"), tmp_path)
    r = capacity.refit(tmp_path)
    assert r["budget_bytes"] == 8 * GIB and r["scale"] == "small"
    assert capacity.refit(tmp_path, GIB)["budget_bytes"] == GIB
    (tmp_path / "density-n4.json").unlink()
    (tmp_path / "density-n8.json").unlink()
    with pytest.raises(ConfigError, match="at least two fan-outs"):
        capacity.refit(tmp_path)
