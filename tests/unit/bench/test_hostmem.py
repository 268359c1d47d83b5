"""Host memory sampling and the Linux-policy accounting, on this process (no VM, no root)."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from azqemu.bench import hostmem as hm

MIB = 1 << 20


@pytest.fixture
def touched_buffer():
    m = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(os.urandom(8 * MIB))
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    yield start, start + 8 * MIB
    # (the ctypes view pins the mmap; let the process end release it)


def test_read_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemAvailable:    400 kB\nHugePages_Total:       3\n")
    assert hm.read_meminfo(str(f)) == {"MemTotal": 1024000, "MemAvailable": 409600, "HugePages_Total": 3}
    real = hm.read_meminfo()
    assert real["MemTotal"] > real["MemAvailable"] > 0


def test_vma_smaps_of_a_touched_buffer(touched_buffer) -> None:
    start, end = touched_buffer
    vma = hm.read_vma_smaps(os.getpid(), start, end)
    assert vma["Size"] >= 8 * MIB and vma["Rss"] >= 8 * MIB and vma["Anonymous"] >= 8 * MIB
    assert vma.get("KSM", 0) == 0 and vma["Swap"] == 0
    roll = hm.read_smaps_rollup(os.getpid())
    assert roll["Pss_Anon"] >= 8 * MIB and roll["Rss"] >= roll["Pss"] > 0
    # An unmapped range matches nothing.
    assert hm.read_vma_smaps(os.getpid(), 0, 4096) == {}


def test_ksm_share_and_linux_owned_bytes() -> None:
    ksm = hm.KsmStat(pages_shared=100, pages_sharing=300)
    assert ksm.share_per_mapping == 0.25
    assert hm.KsmStat().share_per_mapping == 0.0
    zram = {"orig_data_size": 400 * MIB, "mem_used_total": 100 * MIB}
    assert hm.zram_bytes_per_stored_byte(zram) == 0.25
    vma = {"Rss": 300 * MIB, "Anonymous": 200 * MIB, "KSM": 40 * MIB, "Swap": 80 * MIB}
    # 160 private + 40 x 0.25 KSM + 80 x 0.25 zram
    assert hm.linux_owned_bytes(vma, ksm, zram) == (160 + 10 + 20) * MIB
    # Template pages mapped but never copied (Rss - Anonymous) are not owned.
    assert hm.linux_owned_bytes({"Rss": 500 * MIB}, ksm, zram) == 0
    assert hm.qemu_own_bytes({"Pss": 700 * MIB}, {"Pss": 500 * MIB}) == 200 * MIB


def test_zram_mm_stat_reader(tmp_path: Path) -> None:
    for dev, vals in (("zram0", "4096 73 12288 0 12288 1 0 0 0"), ("zram1", "8192 100 4096 0 4096 0 0 0 0")):
        (tmp_path / dev).mkdir()
        (tmp_path / dev / "mm_stat").write_text(f"  {vals}\n")
    assert hm.read_zram_mm_stat("zram0", tmp_path)["mem_used_total"] == 12288
    assert hm.read_zram_mm_stat("zram9", tmp_path) == {}
    total = hm.read_zram_total(tmp_path)
    assert total["orig_data_size"] == 12288 and total["mem_used_total"] == 16384 and total["same_pages"] == 1


def test_read_ksm_from_a_directory(tmp_path: Path) -> None:
    for name, v in (("full_scans", 7), ("pages_shared", 10), ("pages_sharing", 30)):
        (tmp_path / name).write_text(f"{v}\n")
    assert hm.read_ksm(tmp_path) == hm.KsmStat(full_scans=7, pages_shared=10, pages_sharing=30)


def test_time_weighted_average() -> None:
    t = np.array([0.0, 1.0, 3.0])
    assert hm._twa(t, np.array([0.0, 2.0, 2.0])) == pytest.approx((1.0 + 4.0) / 3)
    assert hm._twa(t, np.array([np.nan, 2.0, 4.0])) == pytest.approx(3.0)
    assert np.isnan(hm._twa(t, np.array([np.nan] * 3)))


def test_sampler_records_host_and_processes(touched_buffer) -> None:
    start, end = touched_buffer
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        s = hm.HostMemSampler(interval_s=0.05)
        s.track("self", os.getpid(), ram_range=(start, end))
        with s:
            time.sleep(0.3)
            s.track("child", child.pid)
            time.sleep(0.3)
            s.mark("kill child")
            child.kill()
            child.wait()
            time.sleep(0.3)
        series = s.series
        assert series is not None
        n = len(series.t_s)
        assert 8 <= n <= 25 and np.all(np.diff(series.t_s) > 0)
        assert set(series.host) == set(hm.HOST_KEYS) and all(len(v) == n for v in series.host.values())
        assert np.all(series.host["used_bytes"] > 0)
        me = series.procs["self"]
        assert np.all(me["ram_rss_bytes"] >= 8 * MIB)
        assert np.all(me["owned_linux_bytes"] >= 8 * MIB)
        ch = series.procs["child"]
        seen = ~np.isnan(ch["rss_bytes"])
        # NaN before it was tracked and after it died, numbers in between.
        assert np.isnan(ch["rss_bytes"][0]) and np.isnan(ch["rss_bytes"][-1]) and seen.sum() >= 3
        assert np.all(np.isnan(ch["ram_rss_bytes"]))          # no RAM range given
        assert series.marks and series.marks[0][1] == "kill child"
        assert series.avg("used_bytes") > 0 and series.peak("rss_bytes", "self") >= 8 * MIB
        assert series.sum_over("rss_bytes").shape == series.t_s.shape
        assert s.errors and "child" in s.errors[0]
        assert 0 < series.sample_cost_s < 0.05
        json.dumps(series.to_dict())                            # JSON-ready, NaN as null
        assert series.to_dict()["procs"]["child"]["rss_bytes"][0] is None
    finally:
        child.kill()
        child.wait()


def test_idle_baseline() -> None:
    b = hm.idle_baseline(duration_s=0.3, interval_s=0.1)
    assert b.used_bytes > 0 and b.spread_bytes >= 0 and b.duration_s == 0.3


@pytest.mark.skipif(os.geteuid() != 0, reason="page frame numbers need root")
def test_exact_owned_bytes_of_a_private_buffer(touched_buffer) -> None:
    start, end = touched_buffer
    owned = hm.exact_owned_bytes(os.getpid(), start, end, zram={})
    assert owned.private_bytes == 8 * MIB and owned.owned_bytes == 8 * MIB
    assert owned.swap_bytes == 0 and owned.file_bytes == 0


def test_owned_fn_and_policy_figures(touched_buffer, tmp_path: Path) -> None:
    start, end = touched_buffer
    s = hm.HostMemSampler(interval_s=0.05)
    s.track("linux", os.getpid(), ram_range=(start, end))
    s.track("custom", os.getpid(), owned_fn=lambda: 3 * MIB)
    with s:
        time.sleep(0.3)
    series = s.series
    assert np.all(series.procs["custom"]["owned_bytes"] == 3 * MIB)
    assert np.array_equal(series.procs["linux"]["owned_bytes"], series.procs["linux"]["owned_linux_bytes"])
    base = hm.Baseline(used_bytes=1000, shmem_bytes=0, swap_used_bytes=0, zram_mem_used_bytes=0,
                       duration_s=1, spread_bytes=0)
    fig = hm.policy_figures(series, ["custom"], baseline=base)
    assert fig["owned_bytes_avg"] == fig["owned_bytes_peak"] == 3 * MIB
    assert fig["host_used_bytes_avg"] == pytest.approx(series.avg("used_bytes") - 1000, rel=1e-6)
    assert len(fig["series"]["t_s"]) == len(fig["series"]["owned_bytes"]) == len(series.t_s)
    json.dumps(fig)
    assert hm.latency_summary([1.0, 2.0, 3.0])["median"] == 2.0
    assert np.isnan(hm.latency_summary([])["p95"])


def test_file_allocated_bytes_of_a_memfd() -> None:
    fd = os.memfd_create("azq-test-ram")
    try:
        os.ftruncate(fd, 16 * MIB)
        os.pwrite(fd, b"x" * MIB, 4 * MIB)
        path = hm.find_ram_fd(os.getpid(), "memfd:azq-test-ram")
        assert hm.file_allocated_bytes(path) == MIB          # sparse: only what was written
        with pytest.raises(FileNotFoundError):
            hm.find_ram_fd(os.getpid(), "memfd:nope")
    finally:
        os.close(fd)
