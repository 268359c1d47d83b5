"""The density benchmark's host figures: the idle baseline and tool-latency summary (no VM).

The readers they use are tested in tests/unit/host (test_procfs.py, test_memacct.py).
"""

from __future__ import annotations

import numpy as np

from azqemu.bench import hostmem as hm
from azqemu.host.memacct import KsmStat


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
