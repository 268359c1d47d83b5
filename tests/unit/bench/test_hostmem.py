"""The density benchmark's host figures: the idle baseline and tool-latency summary (no VM).

The readers they use are tested in tests/unit/host (test_procfs.py, test_memacct.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from azqemu.bench import hostmem as hm
from azqemu.host.memacct import KsmStat
from azqemu.units import MIB


def test_sample_host() -> None:
    s = hm.sample_host(zram={"mem_used_total": 7, "orig_data_size": 20}, ksm=KsmStat(pages_sharing=3))
    assert s["used_bytes"] > 0 and s["zram_mem_used_bytes"] == 7 and s["zram_orig_bytes"] == 20
    assert s["ksm_pages_sharing"] == 3 and s["ksm_pages_shared"] == 0


def test_idle_baseline() -> None:
    b = hm.idle_baseline(duration_s=0.3, interval_s=0.1)
    assert b.used_bytes > 0 and b.spread_bytes >= 0 and b.duration_s == 0.3
    assert set(b.parts_bytes) == set(hm.HOST_PARTS) and b.parts_bytes["page_tables"] > 0


def test_host_parts_read_meminfo_fields_in_bytes() -> None:
    parts = hm.host_parts({"AnonPages": 5 << 20, "PageTables": 3 << 20, "Shmem": 1})
    assert parts == {"anon": 5 << 20, "shmem": 1, "page_tables": 3 << 20, "slab_unreclaimable": 0,
                     "kernel_stack": 0}


def test_latency_summary() -> None:
    assert hm.latency_summary([1.0, 2.0, 3.0])["median"] == 2.0
    assert hm.latency_summary([float(x) for x in range(1, 101)])["p95"] == np.percentile(range(1, 101), 95)
    assert np.isnan(hm.latency_summary([])["p95"])


def test_wait_back_to_waits_for_the_host_to_free_what_a_run_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host memory in use falls back after a teardown: the wait ends once it is within the
    slack of the level before the run, and gives up at the timeout when it stays above."""
    total = 1000 * MIB
    used = iter([80 * MIB, 60 * MIB, 30 * MIB, 20 * MIB, 20 * MIB])
    reads: list[int] = []

    def meminfo() -> dict[str, int]:
        u = next(used)
        reads.append(u)
        return {"MemTotal": total, "MemAvailable": total - u}
    monkeypatch.setattr(hm, "read_meminfo", meminfo)
    waited = hm.wait_back_to(10 * MIB, timeout_s=5.0, slack_bytes=16 * MIB, interval_s=0.01)
    assert reads == [80 * MIB, 60 * MIB, 30 * MIB, 20 * MIB] and 0.02 <= waited < 5.0
    monkeypatch.setattr(hm, "read_meminfo", lambda: {"MemTotal": total, "MemAvailable": total - 90 * MIB})
    assert 0.05 <= hm.wait_back_to(10 * MIB, timeout_s=0.05, interval_s=0.01) < 1.0
    # Already back: no wait at all.
    assert hm.wait_back_to(90 * MIB, timeout_s=5.0) < 0.5


def test_a_policy_is_counted_against_the_lower_idle_figure() -> None:
    """A drop across the run (the first figure still held memory being freed) is not the
    policy's saving; a rise (memory that came and stayed) is its cost."""
    assert hm.counted_idle_bytes(1180 * MIB, 1120 * MIB) == 1120 * MIB
    assert hm.counted_idle_bytes(1100 * MIB, 1116 * MIB) == 1100 * MIB
    assert hm.counted_idle_bytes(1100 * MIB, 1100 * MIB) == 1100 * MIB
