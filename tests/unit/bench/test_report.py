"""Density reports from synthetic results (no VM): JSON contract, tables, plots, nightly check."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from azqemu.bench import report
from azqemu.errors import ConfigError

MIB = 1 << 20


def synthetic(seed: int = 0, with_extras: bool = True) -> dict:
    rng = np.random.default_rng(seed)
    owned = {"none": 2048, "none-cow": 1024, "linux": 512, "azqemu": 128}
    lat = {"none": 1.0, "none-cow": 1.0, "linux": 1.3, "azqemu": 1.1}
    pols = {}
    for name, mib in owned.items():
        lats = (lat[name] * rng.lognormal(0, 0.3, 200)).tolist()
        pol = {
            "owned_bytes_avg": mib * MIB, "owned_bytes_peak": int(mib * 1.5 * MIB),
            "host_used_bytes_avg": (mib + 700) * MIB,
            "tool_latency_s": {"median": float(np.median(lats)), "p95": float(np.percentile(lats, 95))},
            "compress_s_total": 0.0 if name.startswith("none") else 12.5,
            "restore_s_total": 0.0 if name.startswith("none") else 3.25,
        }
        if with_extras:
            t = np.arange(0, 60, 0.5)
            pol["series"] = {"t_s": t.tolist(),
                             "owned_bytes": (mib * MIB * (1 + 0.3 * np.sin(t / 5))).tolist(),
                             "host_used_bytes": ((mib + 700) * MIB + 0 * t).tolist()}
            pol["tool_latencies_s"] = lats
            pol["qemu_own_bytes_avg"] = np.float64(60 * MIB)      # numpy values must serialise
        pols[name] = pol
    res = {"workload": "coding-agent", "sandboxes": 8, "policies": pols}
    if with_extras:
        res.update(template_bytes=512 * MIB, seed=1, scale="full")
    return res


def test_ratios_against_both_baselines() -> None:
    r = report.ratios(synthetic())
    assert r["azqemu"]["ratio_vs_none"] == 16.0 and r["azqemu"]["ratio_vs_none_cow"] == 8.0
    assert r["linux"]["ratio_vs_none_cow"] == 2.0 and r["none-cow"]["ratio_vs_none_cow"] == 1.0
    assert r["none-cow"]["slowdown_vs_none_cow"] == 1.0
    assert 1.0 < r["linux"]["slowdown_vs_none_cow"] < 2.0
    res = synthetic()
    del res["policies"]["none"]
    assert report.ratios(res)["azqemu"]["ratio_vs_none"] is None


def test_markdown_table() -> None:
    md = report.markdown_table(synthetic())
    lines = md.splitlines()
    assert lines[0] == "### density: coding-agent, 8 sandboxes (scale full, seed 1)"
    header = lines[2]
    assert header.startswith("| policy | host cost avg MiB | host cost peak MiB | vs none | vs none-cow |")
    assert "| owned avg MiB |" in header and "| QEMU own MiB/sandbox |" in header
    rows = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| policy")]
    assert [r.split("|")[1].strip() for r in rows] == ["none", "none-cow", "linux", "azqemu"]
    az = rows[3].split("|")
    # No host cost in this result: those cells are dashes and the ratios fall back to owned.
    assert az[2].strip() == "—" and az[4].strip() == "16.00x" and az[5].strip() == "8.00x"
    assert az[6].strip() == "128.0" and az[9].strip() == "60.0"
    assert "Template RAM image, counted once: 512.0 MiB." in md
    assert "QEMU's own memory per sandbox (not in owned or host cost): 60.0-60.0 MiB." in md
    assert "a KVM QEMU's own memory is a few tens of MiB" in md and "on owned (no host cost" in md


def test_markdown_names_each_policys_grace() -> None:
    res = synthetic()
    assert "Grace (" not in report.markdown_table(res)      # results from before the field
    res["policies"]["linux"]["grace_s"], res["policies"]["azqemu"]["grace_s"] = 1.0, 0.25
    assert "Grace (seconds of an LLM wait before the policy acts): linux 1, azqemu 0.25." in report.markdown_table(res)


def test_markdown_notes_the_host_parts() -> None:
    res = synthetic()
    res["policies"]["azqemu"]["host_parts_bytes_avg"] = {"anon": 10 << 20, "page_tables": 3 << 20}
    md = report.markdown_table(res)
    assert "Host memory above idle by kind" in md and "azqemu: anon 10.0, page tables 3.0." in md


def test_missing_baseline_shows_a_dash() -> None:
    res = synthetic(with_extras=False)
    del res["policies"]["none"]
    row = next(ln for ln in report.markdown_table(res).splitlines() if ln.startswith("| azqemu"))
    assert row.split("|")[4].strip() == "—"


def with_host_cost(res: dict) -> dict:
    """Host cost per policy: none 3000, none-cow 1500, linux 1000, azqemu 300 MiB."""
    for name, mib in {"none": 3000, "none-cow": 1500, "linux": 1000, "azqemu": 300}.items():
        res["policies"][name].update(host_cost_bytes_avg=mib * MIB, host_cost_bytes_peak=2 * mib * MIB,
                                     manager_anon_above_idle_bytes_avg=5 * MIB, compress_cpu_s_total=7.5)
    return res


def test_ratios_on_host_cost_with_owned_beside() -> None:
    r = report.ratios(with_host_cost(synthetic()))
    assert r["azqemu"]["ratio_vs_none"] == 10.0 and r["azqemu"]["ratio_vs_none_cow"] == 5.0
    assert r["linux"]["ratio_vs_none_cow"] == 1.5
    assert r["azqemu"]["owned_ratio_vs_none"] == 16.0 and r["azqemu"]["owned_ratio_vs_none_cow"] == 8.0
    md = report.markdown_table(with_host_cost(synthetic()))
    az = next(ln for ln in md.splitlines() if ln.startswith("| azqemu")).split("|")
    assert az[2].strip() == "300.0" and az[3].strip() == "600.0" and az[5].strip() == "5.00x"
    assert az[10].strip() == "5.0" and az[15].strip() == "7.50"
    assert "Ratios are baseline / policy on host cost;" in md
    # A policy with no host cost (or none at all) cannot be divided by: no ratio, no crash.
    res = with_host_cost(synthetic())
    res["policies"]["azqemu"]["host_cost_bytes_avg"] = -1.0
    assert report.ratios(res)["azqemu"]["ratio_vs_none"] is None


def test_rich_table_prints() -> None:
    buf = io.StringIO()
    report.print_table(synthetic(), console=Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "coding-agent" in out and "azqemu" in out and "16.0×" in out


def test_table_to_a_log_prints_whole(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Printed to a log or a pipe (``make demo > demo.log``), the density table is as wide as it
    is: rich would squeeze it into 80 columns and cut its headers to "×c…" and "sl…"."""
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    monkeypatch.delenv("COLUMNS", raising=False)
    report.print_table(with_host_cost(synthetic()))
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "policy" in line)
    assert "…" not in header and "×cow" in header and "qemu" in header and "slow" in header
    assert max(len(line) for line in out.splitlines()) > 80
    # A terminal keeps its own width.
    monkeypatch.setenv("FORCE_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "80")
    report.print_table(with_host_cost(synthetic()))
    assert max(len(line) for line in capsys.readouterr().out.splitlines() if "\x1b" not in line) <= 80


def test_write_report_files(tmp_path: Path) -> None:
    files = report.write_report(synthetic(), tmp_path / "out")
    data = json.loads(files.json.read_text())
    # The contract keys are all there, untouched, with the ratios added beside them.
    pol = data["policies"]["azqemu"]
    for key in report.REQUIRED_POLICY_KEYS:
        assert key in pol
    assert pol["owned_bytes_avg"] == 128 * MIB and pol["ratio_vs_none_cow"] == 8.0
    assert pol["qemu_own_bytes_avg"] == 60 * MIB
    assert data["workload"] == "coding-agent" and data["sandboxes"] == 8
    assert files.markdown.read_text().startswith("### density")
    for png in (files.memory_png, files.latency_png):
        assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_plots_are_skipped_without_series(tmp_path: Path) -> None:
    files = report.write_report(synthetic(with_extras=False), tmp_path)
    assert files.memory_png is None and files.latency_png is None
    assert not (tmp_path / "density-memory.png").exists()


def test_json_is_strict() -> None:
    res = synthetic(with_extras=False)
    res["policies"]["linux"]["restore_s_total"] = math.nan
    res["policies"]["linux"]["series"] = {"t_s": np.arange(3), "owned_bytes": [1.0, float("inf"), 2.0]}
    text = report.to_json(res)
    data = json.loads(text)
    assert data["policies"]["linux"]["restore_s_total"] is None
    assert data["policies"]["linux"]["series"]["owned_bytes"] == [1.0, None, 2.0]
    assert "NaN" not in text and "Infinity" not in text


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("workload"), "density result: missing key 'workload'"),
    (lambda r: r.update(policies={}), "density result: 'policies' must be a non-empty object"),
    (lambda r: r["policies"]["linux"].pop("owned_bytes_peak"), "density result: policies.linux has no 'owned_bytes_peak'"),
    (lambda r: r["policies"]["linux"].update(tool_latency_s={"median": 1}),
     "density result: policies.linux.tool_latency_s needs median and p95"),
])
def test_bad_results_are_refused(mutate, message: str) -> None:
    res = synthetic(with_extras=False)
    mutate(res)
    with pytest.raises(ConfigError) as exc:
        report.markdown_table(res)
    assert str(exc.value) == message


