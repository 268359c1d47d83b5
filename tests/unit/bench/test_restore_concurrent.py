"""``azq bench restore --concurrent``: pooled quantiles, overlap, and the run against a fake daemon."""

from __future__ import annotations

import json
import math
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from azqemu.bench import restore_bench as rb
from azqemu.bench import restore_concurrent as rc
from azqemu.errors import SandboxError, SandboxNotFound


def _summary(t_us: np.ndarray) -> dict[str, Any]:
    """What SandboxMemory.memstats gives for a handler's ring of service times."""
    return {"samples": len(t_us), "min": float(t_us.min()), "median": float(np.median(t_us)),
            "p90": float(np.percentile(t_us, 90)), "p99": float(np.percentile(t_us, 99)),
            "max": float(t_us.max())}


def test_one_handler_pools_to_its_own_quantiles() -> None:
    s = _summary(np.random.default_rng(1).lognormal(2.8, 0.3, 5000))
    assert rc.pooled_quantile([s], 0.5) == pytest.approx(s["median"], rel=1e-6)
    assert rc.pooled_quantile([s], 0.99) == pytest.approx(s["p99"], rel=1e-6)
    assert rc.pooled_quantile([s], 0.0) == s["min"]


def test_identical_handlers_pool_to_the_same_quantiles() -> None:
    s = _summary(np.random.default_rng(2).lognormal(2.8, 0.3, 5000))
    p = rc.pooled([s, dict(s), dict(s)])
    assert p["median"] == pytest.approx(s["median"], rel=1e-6)
    assert p["p99"] == pytest.approx(s["p99"], rel=1e-6)
    assert p["samples"] == 15000


def test_pooled_quantiles_are_close_to_those_of_all_samples() -> None:
    rng = np.random.default_rng(3)
    fast = rng.lognormal(2.7, 0.25, 8000)        # ~15 us
    slow = rng.lognormal(3.6, 0.5, 3000)         # ~37 us, a handler that waited on the others
    tail = np.concatenate([rng.lognormal(2.9, 0.3, 4000), rng.uniform(200, 400, 40)])
    parts = [fast, slow, tail]
    p = rc.pooled([_summary(t) for t in parts])
    every = np.concatenate(parts)
    assert p["median"] == pytest.approx(float(np.median(every)), rel=0.08)
    # An estimate from five points per handler: ~10% off at p99 on this skewed mix.
    assert p["p99"] == pytest.approx(float(np.percentile(every, 99)), rel=0.12)
    # Always between the handlers' own quantiles, which are reported beside it.
    for q in ("median", "p99"):
        assert p["per_handler"][q]["min"] <= p[q] <= p["per_handler"][q]["max"]
    assert p["median"] <= p["p99"]


def test_handlers_without_samples_are_left_out() -> None:
    s = _summary(np.array([10.0, 20.0, 30.0]))
    p = rc.pooled([s, {"samples": 0}])
    assert p["median"] == pytest.approx(20.0) and p["samples"] == 3
    assert math.isnan(rc.pooled_quantile([{"samples": 0}], 0.5))
    assert rc.pooled([])["per_handler"] == {}


def test_summaries_off_by_rounding_still_pool() -> None:
    # np.percentile of a tiny ring can put p90 a hair under the median in float: made monotone.
    s = {"samples": 2, "min": 5.0, "median": 7.0, "p90": 6.999999, "p99": 8.0, "max": 8.0}
    assert 5.0 <= rc.pooled_quantile([s], 0.5) <= 8.0


def test_overlap() -> None:
    assert rc.overlap([(0.0, 10.0), (1.0, 9.0), (2.0, 12.0)]) == {
        "overlap_s": 7.0, "span_s": 12.0, "start_spread_s": 2.0}
    assert rc.overlap([(0.0, 1.0), (2.0, 3.0)])["overlap_s"] == 0.0


def test_table_line_for_the_concurrent_figure() -> None:
    res = {"fault_service_us": {"median": 14.0, "p99": 120.0}, "fault_stall_us": {"median": 30.0, "p99": 90.0},
           "prefetch_mib_s": 1500.0, "resume_s": 0.2, "hot_set_mib": 110.0,
           "faults_after_resume": {"with_prefetch": 40, "without_prefetch": 28000},
           "faults_removed_fraction": 1 - 40 / 28000,
           "concurrent": {"sandboxes": 16, "fault_service_us": {"median": 41.5, "p99": 870.25},
                          "overlap_s": 9.0, "span_s": 10.0}}
    lines = rb.format_table(res).splitlines()
    med = next(line for line in lines if line.startswith("fault service median, 16 at once (us)"))
    assert med.split()[-1] == "41.5"
    p99 = next(line for line in lines if line.startswith("fault service p99, 16 at once")).split()
    assert p99[-5:] == ["870.2", "<=", "100", "NOT", "met"]
    assert lines[-1].split()[-1] == "90"
    assert rb.targets_met(res)["concurrent.fault_service_us.p99"] is False


class FakeDaemon:
    """Just enough of Client for restore_concurrent.run: guests answer the working-set
    program's protocol, each handler reports faults and a service summary per window."""

    def __init__(self, *, fail_touch: str | None = None) -> None:
        self.sandboxes: set[str] = set()
        self.destroyed: list[str] = []
        self.faults: dict[str, int] = {}
        self.window: dict[str, list[float]] = {}
        self.fail_touch = fail_touch
        self.lock = threading.Lock()

    def memstats(self, name: str, reset: bool = False) -> Any:
        if name not in self.sandboxes:
            raise SandboxNotFound(name)
        with self.lock:
            t = np.array(self.window[name] or [0.0])
            out = {"handler": {"faults": self.faults[name], "errors": 0},
                   "service_us": _summary(t) if self.window[name] else {"samples": 0}}
            if reset:
                self.window[name] = []
        return SimpleNamespace(as_json=lambda: out)

    def template_list(self) -> list[Any]:
        return [SimpleNamespace(name="small", as_json=lambda: {"name": "small", "mem_mib": 256})]

    def clone(self, template: str, *, names: list[str], ram_mode: str, policy: str) -> list[Any]:
        assert (template, ram_mode, policy) == ("small", "lazy", "manual")
        for n in names:
            self.sandboxes.add(n)
            self.faults[n], self.window[n] = 0, []
        return []

    def destroy(self, name: str) -> None:
        self.sandboxes.discard(name)
        self.destroyed.append(name)

    def compress(self, name: str) -> Any:
        return SimpleNamespace(as_json=lambda: {"stored_pages": 1000})

    def resume(self, name: str, prefetch: bool = True) -> Any:
        assert prefetch is False
        return SimpleNamespace(as_json=lambda: {"resume_s": 0.01})

    def exec(self, name: str, argv: list[str], timeout_s: float = 0, stdin: bytes | None = None) -> Any:
        cmd = argv[-1]
        out = ""
        if "if [ -e ready ]" in cmd:
            out = "READY\n"
        elif "echo touch" in cmd:
            if name == self.fail_touch:
                return SimpleNamespace(exit_code=1, stdout=b"", stderr=b"boom", duration_s=0.1)
            k = int(name.rsplit("-c", 1)[1])
            with self.lock:   # handler k serves 100 faults at (k + 1) * 10 us
                self.faults[name] += 100
                self.window[name] += [(k + 1) * 10.0] * 99 + [(k + 1) * 100.0]
            stall = {"p10": 20e3, "median": 30e3, "p90": 40e3, "p99": 50e3, "max": 60e3}
            out = json.dumps({"pages": 100, "stall_ns": stall})
        return SimpleNamespace(exit_code=0, stdout=out.encode(), stderr=b"", duration_s=0.5)


def test_run_measures_every_handler_and_destroys_the_clones() -> None:
    d = FakeDaemon()
    r = rc.run(d, template="small", sandboxes=3, hot_mib=4)   # type: ignore[arg-type]
    assert r["sandboxes"] == 3 and r["faults"] == 300 and r["template"] == "small"
    svc = r["fault_service_us"]
    assert svc["samples"] == 300
    assert 10.0 <= svc["median"] <= 30.0 and svc["median"] <= svc["p99"] <= 300.0
    assert svc["per_handler"]["median"] == {"min": 10.0, "max": 30.0}
    assert r["fault_stall_us"]["median"] == pytest.approx(30.0)
    assert r["overlap_s"] <= r["span_s"]
    assert [p["faults"] for p in r["per_sandbox"]] == [100, 100, 100]
    assert not d.sandboxes and len(d.destroyed) == 3
    json.dumps(r)


def test_a_failed_guest_destroys_every_clone() -> None:
    names = rc.names_for(2)
    d = FakeDaemon(fail_touch=names[1])
    with pytest.raises(SandboxError):
        rc.run(d, template="small", sandboxes=2, hot_mib=4)   # type: ignore[arg-type]
    assert not d.sandboxes and sorted(d.destroyed) == sorted(names)
