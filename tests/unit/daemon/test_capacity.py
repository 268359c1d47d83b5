"""The capacity figure from measured costs, a density result or the template's size."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from azqemu import config as config_mod
from azqemu.daemon import capacity
from azqemu.errors import ConfigError
from azqemu.units import GIB, MIB

MEMINFO = {"MemTotal": 16 * GIB, "MemAvailable": 10 * GIB}


def est(**kw: object) -> capacity.Capacity:
    args: dict = dict(template="t", policy=None, guest_bytes=512 * MIB, costs=[], bench=None,
                      meminfo=MEMINFO, reserve_bytes=1 * GIB)
    args.update(kw)
    return capacity.estimate(**args)


def test_running_sandboxes_give_the_mean_cost() -> None:
    cap = est(costs=[100 * MIB, 156 * MIB])
    assert (cap.source, cap.measured_sandboxes, cap.cost_bytes) == ("running", 2, 128 * MIB)
    assert cap.fits == 9 * GIB // (128 * MIB) == 72
    assert cap.allocation_ratio == 4.0


def test_benchmark_figure_when_nothing_runs(tmp_path: Path) -> None:
    cap = est(bench=(256 * MIB, tmp_path / "density.json"))
    assert (cap.source, cap.cost_bytes, cap.fits, cap.allocation_ratio) == ("benchmark", 256 * MIB, 36, 2.0)
    assert cap.bench_file == str(tmp_path / "density.json")


def test_nothing_measured_is_the_whole_template_and_ratio_one() -> None:
    cap = est()
    assert (cap.source, cap.cost_bytes, cap.fits, cap.allocation_ratio) == ("template", 512 * MIB, 18, 1.0)


def test_reserve_above_available_fits_nothing() -> None:
    assert est(reserve_bytes=11 * GIB).fits == 0


def test_a_template_without_memory_is_refused() -> None:
    with pytest.raises(ConfigError):
        est(guest_bytes=0)


@pytest.mark.parametrize(("text", "n"), [("512M", 512 * MIB), ("2G", 2 * GIB), ("1.5GiB", 3 * GIB // 2),
                                         ("4096", 4096), ("64k", 64 * 1024)])
def test_parse_size(text: str, n: int) -> None:
    assert capacity.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "lots", "-1G"])
def test_parse_size_refuses(text: str) -> None:
    with pytest.raises(ConfigError):
        capacity.parse_size(text)


def write_density(path: Path, policies: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"workload": "w", "sandboxes": 4, "policies": policies}))
    return path


def test_bench_cost_takes_the_first_result_that_measured_the_policy(tmp_path: Path) -> None:
    a = write_density(tmp_path / "a" / "density.json", {"none": {"owned_bytes_avg_per_sandbox": 9e8}})
    b = write_density(tmp_path / "b" / "density.json",
                      {"agentzip": {"owned_bytes_avg_per_sandbox": 1e8, "qemu_own_bytes_avg": 5e7}})
    broken = tmp_path / "c" / "density.json"
    broken.parent.mkdir()
    broken.write_text("{not json")
    assert capacity.bench_cost([broken, a, b], "agentzip") == (150_000_000, b)
    assert capacity.bench_cost([a], "agentzip") is None


def test_bench_candidates_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_mod.Config(state_dir=tmp_path / "state", run_dir=tmp_path / "run", image_cache_dir=tmp_path,
                            libvirt_uri="test:///default", shm_dir=tmp_path / "shm")
    old = write_density(tmp_path / "state" / "nightly" / "old" / "density.json", {})
    new = write_density(tmp_path / "state" / "nightly" / "new" / "density.json", {})
    os.utime(old, (1, 1))
    local = write_density(tmp_path / "cwd" / "results" / "demo-1" / "density.json", {})
    monkeypatch.setenv("AZQ_DENSITY_RESULT", str(tmp_path / "explicit.json"))
    got = capacity.bench_candidates(cfg, cwd=tmp_path / "cwd")
    assert got == [tmp_path / "explicit.json", new, old, local]
