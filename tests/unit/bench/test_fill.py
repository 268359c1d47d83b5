"""The fill check's verdicts and its prediction from a capacity sweep (pure parts)."""

from __future__ import annotations

import pytest

from azqemu.bench import fill
from azqemu.errors import ConfigError

MIB = 1 << 20


def verdict(lat: list[float], base: float | None = 1.0, **kw: object) -> str | None:
    args = {"failed": 0, "oom_kills": 0, "died": False, "over_budget": False}
    args.update(kw)
    return fill.window_verdict(lat, base, 1.5, **args)  # type: ignore[arg-type]


def test_a_window_passes_within_the_bound_and_fails_past_it() -> None:
    assert verdict([1.0, 1.2, 1.4]) is None
    assert verdict([1.4, 1.6, 1.7]) == "latency"
    assert verdict([5.0], base=None) is None            # the first window sets the base
    assert verdict([], base=1.0) is None                # no call ended: nothing to judge


def test_failures_come_before_latency_in_this_order() -> None:
    slow = [9.0]
    assert verdict(slow, oom_kills=1, died=True, failed=2, over_budget=True) == "oom"
    assert verdict(slow, died=True, failed=2, over_budget=True) == "sandbox-died"
    assert verdict(slow, failed=2, over_budget=True) == "step-failed"
    assert verdict(slow, over_budget=True) == "over-budget"
    assert {"oom", "sandbox-died", "step-failed", "over-budget", "latency"} <= set(fill.STOPS)


def test_the_prediction_is_the_capacity_fit_with_qemu_for_this_budget() -> None:
    cap = {"policies": {"agentzip": {"fixed_host_cost_bytes": 100 * MIB, "marginal_host_cost_bytes": 10 * MIB,
                                     "qemu_own_bytes_per_sandbox": 70 * MIB},
                        "linux": {"fixed_host_cost_bytes": 0, "marginal_host_cost_bytes": -1.0}}}
    assert fill.predicted(cap, "agentzip", 1000 * MIB) == 11     # (1000 - 100) / 80
    assert fill.predicted(cap, "linux", 1000 * MIB) is None      # no positive slope: no figure
    assert fill.predicted(cap, "none-cow", 1000 * MIB) is None
    assert fill.predicted(None, "agentzip", 1000 * MIB) is None


@pytest.mark.parametrize("kw", [{"step": 0}, {"max_sandboxes": 0}, {"window_s": 0.0}, {"slowdown": 1.0}])
def test_bad_settings_are_refused_before_anything_runs(kw: dict[str, float]) -> None:
    from azqemu.bench.workload import load
    with pytest.raises(ConfigError):
        fill.run_fill(load("coding-agent"), ["agentzip"], 512 * MIB, **kw)  # type: ignore[arg-type]


def test_an_unknown_policy_is_refused_before_anything_runs() -> None:
    from azqemu.bench.workload import load
    from azqemu.errors import AzqemuError
    with pytest.raises(AzqemuError):
        fill.run_fill(load("coding-agent"), ["no-such-policy"], 512 * MIB)


def test_the_table_names_every_policy_and_its_stop() -> None:
    point = {"sandboxes": 4, "usage_bytes_avg": 300.0 * MIB, "usage_bytes_peak": 400.0 * MIB, "zram_bytes_avg": 0.0,
             "tool_calls": 20, "tool_latency_median_s": 0.8, "tool_latency_p95_s": 2.0, "failed_steps": 0,
             "oom_kills": 0, "passed": True, "stop_reason": None}
    res = {"workload": "coding-agent", "budget_bytes": 1024 * MIB, "step": 2, "window_s": 30.0, "slowdown_bound": 1.5,
           "policies": {"agentzip": {"filled": 4, "stop_reason": "oom", "predicted_with_qemu": 5,
                                     "points": [point, dict(point, sandboxes=6, passed=False, stop_reason="oom")]}}}
    t = fill.table(res)
    assert "| agentzip | 4 | oom | 5 | 400 | 0.80 |" in t
