"""``azq bench restore`` end to end at a small size: the JSON contract and figures that agree.

Checks the keys nightly tooling reads (DESIGN.md, "Figures the benchmarks print") and that
the numbers are positive and consistent with each other, not the performance targets (those
are the benchmark's to report: tests/perf/test_restore_bench.py).
"""

from __future__ import annotations

import json

import pytest

from azqemu.bench.restore_bench import CLONE_PREFIX
from azqemu.client import Client
from azqemu.host.doctor import restore_mode

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]
HOT_MIB = 16
PAGES_PER_MIB = 256


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    mode, why = restore_mode()
    if mode != "lazy":
        pytest.skip(f"no userfaultfd export here: {why}")


def test_bench_restore_json_contract_and_consistent_figures(azq, template: str) -> None:
    r = azq("bench", "restore", "--hot-mib", str(HOT_MIB), "--template", template, "--json", timeout=900)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)

    for key in ("fault_service_us", "fault_stall_us"):
        assert {"median", "p99"} <= res[key].keys()
        assert 0 < res[key]["median"] <= res[key]["p99"], (key, res[key])
    assert res["prefetch_mib_s"] > 0
    assert res["resume_s"] > 0
    faults = res["faults_after_resume"]
    assert set(faults) >= {"with_prefetch", "without_prefetch"}
    assert all(isinstance(faults[k], int) for k in ("with_prefetch", "without_prefetch"))
    # Without prefetch every page of the working set comes back through a fault.
    assert faults["without_prefetch"] >= HOT_MIB * PAGES_PER_MIB
    assert 0 <= faults["with_prefetch"] < faults["without_prefetch"]
    assert res["faults_removed_fraction"] == pytest.approx(
        1 - faults["with_prefetch"] / faults["without_prefetch"])
    # The prefetched hot set holds the working set; service samples cover the faults.
    assert res["prefetched_pages"] >= HOT_MIB * PAGES_PER_MIB
    assert res["fault_service_us"]["samples"] >= HOT_MIB * PAGES_PER_MIB
    assert res["fault_stall_us"]["pages"] == HOT_MIB * PAGES_PER_MIB
    assert res["handler_errors"] == 0
    # The C thread's spin after a fault: what it caught and the time it spun, per fault of the call.
    spin = res["fault_spin"]
    assert spin["caught"] >= 0 and spin["spun_s"] >= 0
    assert spin["spun_us_per_fault"] == pytest.approx(spin["spun_s"] * 1e6 / faults["without_prefetch"])
    assert set(res["targets_met"]) >= {"fault_service_us.median", "prefetch_mib_s", "resume_s"}
    # Everything the benchmark made is gone.
    assert not [s.name for s in Client().list_sandboxes() if s.name.startswith(CLONE_PREFIX)]


def test_bench_restore_table(azq, template: str) -> None:
    r = azq("bench", "restore", "--hot-mib", "4", "--template", template, timeout=900)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[:2] == ["figure", "measured"]
    assert any(line.startswith("faults removed by prefetch (%)") for line in lines)


def test_bench_restore_refuses_a_working_set_larger_than_the_guest(azq, template: str) -> None:
    r = azq("bench", "restore", "--hot-mib", "100000", "--template", template)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"azq: --hot-mib 100000 out of range for template '{template}' (512 MiB guest): 1-256"]
    r = azq("bench", "restore", "--hot-mib", "100000", "--template", template, "--json")   # the error as JSON
    assert r.returncode == 2 and r.stderr == ""
    err = json.loads(r.stdout)["error"]
    assert (err["type"], err["exit_code"]) == ("ConfigError", 2) and err["message"].startswith("--hot-mib 100000")
    assert not [s.name for s in Client().list_sandboxes() if s.name.startswith(CLONE_PREFIX)]


def test_bench_restore_concurrent_json_contract(azq, template: str) -> None:
    """``--concurrent 2``: two sandboxes fault at once; the pooled figures are plausible."""
    n, hot_mib = 2, 4
    r = azq("bench", "restore", "--hot-mib", "4", "--template", template, "--concurrent", str(n),
            "--concurrent-hot-mib", str(hot_mib), "--json", timeout=1200)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert {"median", "p99"} <= res["fault_service_us"].keys()   # the single-sandbox keys stay
    conc = res["concurrent"]
    assert conc["sandboxes"] == n
    svc = conc["fault_service_us"]
    assert 0 < svc["median"] <= svc["p99"], svc
    for q in ("median", "p99"):
        assert svc["per_handler"][q]["min"] <= svc[q] <= svc["per_handler"][q]["max"]
    # Every sandbox's working set came back through its own handler, every fault sampled.
    assert len(conc["per_sandbox"]) == n
    assert all(p["faults"] >= hot_mib * PAGES_PER_MIB for p in conc["per_sandbox"])
    assert svc["samples"] >= n * hot_mib * PAGES_PER_MIB
    assert 0 < conc["fault_stall_us"]["median"] <= conc["fault_stall_us"]["p99"]
    assert conc["span_s"] > 0 and 0 <= conc["overlap_s"] <= conc["span_s"]
    assert conc["handler_errors"] == 0
    assert not [s.name for s in Client().list_sandboxes() if s.name.startswith(CLONE_PREFIX)]
