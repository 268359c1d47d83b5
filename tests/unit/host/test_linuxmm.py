"""The Linux configuration's pure parts (no root, nothing changed on the host).

Page-out and memory cgroups are in test_reclaim.py, the procfs readers in test_procfs.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from azqemu.errors import NotRoot
from azqemu.host import linuxmm, memacct
from azqemu.host.memacct import KsmStat


def test_selected_choice() -> None:
    assert linuxmm._selected("[none] scan-time") == "none"
    assert linuxmm._selected("lzo [lzo-rle] lz4") == "lzo-rle"
    assert linuxmm._selected("60") == "60"


def test_read_swaps(tmp_path: Path) -> None:
    f = tmp_path / "swaps"
    f.write_text("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
                 "/dev/zram1                              partition\t262140\t\t0\t\t100\n"
                 "/swapfile                               file\t\t1048572\t\t5\t\t-2\n")
    assert linuxmm.read_swaps(f) == [linuxmm.SwapEntry("/dev/zram1", "partition", 262140, 100),
                                linuxmm.SwapEntry("/swapfile", "file", 1048572, -2)]


def test_snapshot_diff() -> None:
    a = linuxmm.HostSnapshot(ksm={"run": "0", "pages_to_scan": "100"}, zswap={"enabled": "N"},
                        sysctl={"swappiness": "60"}, swaps=[], zram={"zram0": {"initstate": "0"}},
                        zram_loaded=True)
    b = linuxmm.HostSnapshot(ksm={"run": "1", "pages_to_scan": "100"}, zswap={"enabled": "N"},
                        sysctl={"swappiness": "180"}, swaps=[{"name": "/dev/zram1"}],
                        zram={"zram0": {"initstate": "0"}, "zram1": {"initstate": "1"}}, zram_loaded=True)
    assert a.diff(a) == []
    assert a.diff(b) == ["ksm.run: '0' -> '1'", "sysctl.swappiness: '60' -> '180'",
                         "swaps: [] -> [{'name': '/dev/zram1'}]",
                         "zram.zram1: None -> {'initstate': '1'}"]


def test_snapshot_of_this_host_reads_without_root() -> None:
    snap = linuxmm.HostSnapshot.take()
    assert "swappiness" in snap.sysctl
    if memacct.KSM_DIR.is_dir():
        assert snap.ksm["run"] in ("0", "1", "2")


def test_wait_ksm_converged_logic(monkeypatch: pytest.MonkeyPatch) -> None:
    # full_scans advance; pages_sharing 0 -> 500 -> 990 -> 1000 -> 1000
    seq = iter([KsmStat(full_scans=0)] + [KsmStat(full_scans=s, pages_sharing=v)
               for s, v in [(0, 0), (1, 500), (1, 500), (2, 990), (3, 1000), (4, 1000), (5, 1000)]])
    monkeypatch.setattr(linuxmm, "read_ksm", lambda: next(seq))
    conv = linuxmm.wait_ksm_converged(timeout_s=5, poll_s=0, tolerance_fraction=0.0)
    assert conv.converged and conv.stat.pages_sharing == 1000 and conv.full_scans == 4
    # A 1% tolerance accepts 990 -> 1000 one scan earlier.
    seq2 = iter([KsmStat(full_scans=0)] + [KsmStat(full_scans=s, pages_sharing=v)
                for s, v in [(1, 500), (2, 990), (3, 1000)]])
    monkeypatch.setattr(linuxmm, "read_ksm", lambda: next(seq2))
    assert linuxmm.wait_ksm_converged(timeout_s=5, poll_s=0).full_scans == 3


def test_wait_ksm_converged_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(linuxmm, "read_ksm", lambda: KsmStat(full_scans=0))
    conv = linuxmm.wait_ksm_converged(timeout_s=0.05, poll_s=0.01)
    assert not conv.converged and conv.full_scans == 0


def test_setup_needs_root(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: tests/integration/test_linux_config.py covers set-up")
    with pytest.raises(NotRoot):
        linuxmm.LinuxConfig(record_dir=tmp_path).setup()


def test_zram_disksize_follows_the_guests_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    # zram's table costs memory in proportion to the disk size once it is set: the device
    # holds what the guests can swap, their RAM together, and no more than half the host.
    monkeypatch.setattr(linuxmm, "_meminfo_bytes", lambda key: {"MemTotal": 24 << 30}[key])
    assert linuxmm.zram_disksize_for(8 * (512 << 20)) == 4 << 30
    assert linuxmm.zram_disksize_for(64 * (512 << 20)) == 12 << 30
    assert linuxmm.zram_disksize_for((1 << 20) + 100) == 1 << 20       # whole pages
    assert linuxmm.zram_disksize_for(100) == 4096
    with pytest.raises(ValueError, match="positive"):
        linuxmm.zram_disksize_for(0)
