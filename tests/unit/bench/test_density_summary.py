"""The density summary's arithmetic: host cost = host used above idle - QEMU's own memory,
sample by sample; the manager's own memory above the idle manager; compression CPU."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import pytest

from azqemu.bench import report
from azqemu.bench.density import PolicyRun, StepResult, rebase_host_series, summarize

MIB = 1 << 20


def _run(policy: str, used_mib: list[float], qemu_mib: list[float], *, anon_mib: list[float] | None = None,
         extra: dict[str, Any] | None = None, with_cost_series: bool = True) -> PolicyRun:
    t = [float(i) for i in range(len(used_mib))]
    series: dict[str, list[float]] = {
        "t_s": t, "owned_bytes": [10.0 * MIB] * len(t), "host_used_bytes": [u * MIB for u in used_mib],
        "store_bytes": [0.0] * len(t), "zram_bytes": [0.0] * len(t), "manager_rss_bytes": [80.0 * MIB] * len(t),
        "qemu_own_bytes": [q * MIB for q in qemu_mib]}
    if with_cost_series:
        series["host_cost_bytes"] = [(u - q) * MIB for u, q in zip(used_mib, qemu_mib)]
        series["manager_anon_bytes"] = [a * MIB for a in (anon_mib or [0.0] * len(t))]
    steps = [StepResult(0, 0, "t", 0, 1.0, "x")]
    return PolicyRun(policy, series, steps, dict(extra or {}))


def test_host_cost_is_host_used_minus_qemu_own() -> None:
    runs = [_run("none-cow", [400, 600, 600], [200, 300, 300], anon_mib=[30, 31, 32],
                 extra={"manager_idle_anon_bytes": 30 * MIB, "compress_s_total": 0.0}),
            _run("agentzip", [300, 500, 300], [200, 300, 300], anon_mib=[30, 40, 30],
                 extra={"manager_idle_anon_bytes": 28 * MIB, "compress_s_total": 2.0,
                        "compress_cpu_s_total": 1.25})]
    res = summarize(SimpleNamespace(name="w"), 2, runs, 100 * MIB)  # type: ignore[arg-type]
    cow, az = res["policies"]["none-cow"], res["policies"]["agentzip"]
    # Host cost per sample: 200, 300, 300 MiB -> time-weighted average 275, peak 300.
    assert cow["host_cost_bytes_avg"] == pytest.approx(275 * MIB)
    assert cow["host_cost_bytes_peak"] == 300 * MIB
    # agentzip: 100, 200, 0 -> average 125, peak 200.
    assert az["host_cost_bytes_avg"] == pytest.approx(125 * MIB) and az["host_cost_bytes_peak"] == 200 * MIB
    # QEMU's own memory stays per sandbox (2 sandboxes): (200+300)/2/2 ... time-weighted 275/2.
    assert cow["qemu_own_bytes_avg"] == pytest.approx(275 * MIB / 2)
    assert az["manager_anon_above_idle_bytes_avg"] == pytest.approx((35 - 28) * MIB)
    assert cow["manager_anon_above_idle_bytes_avg"] == pytest.approx((31 - 30) * MIB)
    assert az["compress_cpu_s_total"] == 1.25 and cow["compress_cpu_s_total"] == 0.0
    # Every earlier key is still there.
    for key in report.REQUIRED_POLICY_KEYS + ("manager_rss_bytes_avg", "host_used_bytes_avg",
                                              "owned_bytes_avg_per_sandbox", "store_bytes_avg"):
        assert key in az
    # The ratio against none-cow is taken on host cost: 275 / 125.
    assert report.ratios(res)["agentzip"]["ratio_vs_none_cow"] == pytest.approx(2.2)


def test_series_without_host_cost_are_derived() -> None:
    run = _run("linux", [500, 700], [100, 300], with_cost_series=False)
    pol = summarize(SimpleNamespace(name="w"), 1, [run], 0)["policies"]["linux"]  # type: ignore[arg-type]
    assert pol["host_cost_bytes_avg"] == pytest.approx(400 * MIB) and pol["host_cost_bytes_peak"] == 400 * MIB
    assert math.isnan(pol["manager_anon_above_idle_bytes_avg"])


class _PerWaitClient:
    """owned() and domstats() as the daemon answers them at the end of a policy's run."""

    def __init__(self, cpu_s: dict[str, float], counts: dict[str, int], encoded: dict[str, int] | None = None) -> None:
        self.cpu_s, self.counts, self.encoded = cpu_s, counts, encoded or {}

    def owned(self, names: list[str]) -> Any:
        rows = {n: {"name": n, "compress_cpu_s_total": self.cpu_s[n],
                    "compress_encoded_bytes_total": self.encoded.get(n, 0)} for n in names}
        return SimpleNamespace(as_json=lambda: {"sandboxes": rows})

    def domstats(self, name: str) -> Any:
        return SimpleNamespace(compress_count=self.counts[name])


def test_compression_cpu_per_wait() -> None:
    from azqemu.bench.density import compress_cpu_per_wait
    c = _PerWaitClient({"a": 1.5, "b": 0.5}, {"a": 3, "b": 1}, {"a": 3 * MIB, "b": 1 * MIB})
    assert compress_cpu_per_wait(c, ["a", "b"]) == {  # type: ignore[arg-type]
        "compressions": 4, "compress_cpu_s_per_wait": pytest.approx(0.5),
        "compress_encoded_bytes_total": 4 * MIB, "compress_cpu_s_per_encoded_mib": pytest.approx(0.5)}
    # No compression (none, none-cow, linux): no figure, not a division by zero.
    c = _PerWaitClient({"a": 0.0}, {"a": 0})
    assert compress_cpu_per_wait(c, ["a"]) == {"compressions": 0,  # type: ignore[arg-type]
                                               "compress_cpu_s_per_wait": None, "compress_encoded_bytes_total": 0,
                                               "compress_cpu_s_per_encoded_mib": None}
    # It reaches the policy's figures and the report's column.
    run = _run("agentzip", [300, 500], [200, 300], extra={"compressions": 4, "compress_cpu_s_per_wait": 0.5})
    res = summarize(SimpleNamespace(name="w"), 2, [run], 0)  # type: ignore[arg-type]
    assert res["policies"]["agentzip"]["compress_cpu_s_per_wait"] == 0.5
    row = report.table_rows(res)[0]
    assert row[-1] == "0.500" and report.HEADERS[-1] == "compress CPU s/wait"
    assert json.loads(report.to_json(res))["policies"]["agentzip"]["compressions"] == 4


def test_outputs_compare_without_the_run_time_tools_print() -> None:
    from azqemu.bench.density import comparable_output
    a = b"..\n----------------------------------------------------------------------\nRan 12 tests in 0.413s\n\nOK\n"
    b = a.replace(b"0.413s", b"1.9s")
    assert comparable_output(a) == comparable_output(b)
    # Only that line: a changed result or count still differs.
    assert comparable_output(a) != comparable_output(a.replace(b"OK", b"FAILED (failures=1)"))
    assert comparable_output(a) != comparable_output(a.replace(b"Ran 12", b"Ran 11"))
    assert comparable_output(b"took 0.4s\n") == b"took 0.4s\n"
    # ls -l's modification times are the wall clock's (guests keep the host's): masked, the
    # rest of the line (mode, size, name) still compared.
    ls_a = b"-rw-r--r-- 1 root root 1040 Dec  6 09:53 data.csv.gz\n-rw-r--r-- 1 root root 9 Dec  6  2025 old\n"
    ls_b = b"-rw-r--r-- 1 root root 1040 Dec  6 10:01 data.csv.gz\n-rw-r--r-- 1 root root 9 Nov 30  2025 old\n"
    assert comparable_output(ls_a) == comparable_output(ls_b)
    assert comparable_output(ls_a) != comparable_output(ls_b.replace(b"1040", b"1041"))
    assert comparable_output(b"see Dec  6 09:53\n") == b"see Dec  6 09:53\n"     # not an ls column


def test_a_drop_of_the_idle_host_raises_the_run_s_host_figures() -> None:
    """Sampled against an idle figure 60 MiB too high, a run's host used and host cost rise by
    as much; owned memory, QEMU's own memory and the rest stay as sampled."""
    run = _run("linux", [400, 500], [300, 300])
    rebase_host_series(run.series, 60 * MIB)
    assert run.series["host_used_bytes"] == [460 * MIB, 560 * MIB]
    assert run.series["host_cost_bytes"] == [160 * MIB, 260 * MIB]
    assert run.series["qemu_own_bytes"] == [300 * MIB, 300 * MIB]
    assert run.series["owned_bytes"] == [10.0 * MIB] * 2
    pol = summarize(SimpleNamespace(name="w"), 2, [run], 0)["policies"]["linux"]  # type: ignore[arg-type]
    assert pol["host_cost_bytes_avg"] == pytest.approx(210 * MIB) and pol["host_cost_bytes_peak"] == 260 * MIB
    unchanged = _run("linux", [400, 500], [300, 300])
    rebase_host_series(unchanged.series, 0)
    assert unchanged.series["host_cost_bytes"] == [100 * MIB, 200 * MIB]
