"""The Linux configuration's pure parts (no root, nothing changed on the host)."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from azqemu.bench import linux_config as lc
from azqemu.bench.hostmem import KsmStat
from azqemu.errors import HostError


def test_selected_choice() -> None:
    assert lc._selected("[none] scan-time") == "none"
    assert lc._selected("lzo [lzo-rle] lz4") == "lzo-rle"
    assert lc._selected("60") == "60"


def test_read_swaps(tmp_path: Path) -> None:
    f = tmp_path / "swaps"
    f.write_text("Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
                 "/dev/zram1                              partition\t262140\t\t0\t\t100\n"
                 "/swapfile                               file\t\t1048572\t\t5\t\t-2\n")
    assert lc.read_swaps(f) == [lc.SwapEntry("/dev/zram1", "partition", 262140, 100),
                                lc.SwapEntry("/swapfile", "file", 1048572, -2)]


def test_snapshot_diff() -> None:
    a = lc.HostSnapshot(ksm={"run": "0", "pages_to_scan": "100"}, zswap={"enabled": "N"},
                        sysctl={"swappiness": "60"}, swaps=[], zram={"zram0": {"initstate": "0"}},
                        zram_loaded=True)
    b = lc.HostSnapshot(ksm={"run": "1", "pages_to_scan": "100"}, zswap={"enabled": "N"},
                        sysctl={"swappiness": "180"}, swaps=[{"name": "/dev/zram1"}],
                        zram={"zram0": {"initstate": "0"}, "zram1": {"initstate": "1"}}, zram_loaded=True)
    assert a.diff(a) == []
    assert a.diff(b) == ["ksm.run: '0' -> '1'", "sysctl.swappiness: '60' -> '180'",
                         "swaps: [] -> [{'name': '/dev/zram1'}]",
                         "zram.zram1: None -> {'initstate': '1'}"]


def test_snapshot_of_this_host_reads_without_root() -> None:
    snap = lc.HostSnapshot.take()
    assert "swappiness" in snap.sysctl
    if lc.KSM_DIR.is_dir():
        assert snap.ksm["run"] in ("0", "1", "2")


CHILD = textwrap.dedent("""
    import mmap, os, sys, ctypes
    big = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    fd = os.memfd_create("azq-ram")
    os.ftruncate(fd, 32 << 20)
    mem = mmap.mmap(fd, 32 << 20, flags=mmap.MAP_SHARED)
    a = ctypes.addressof(ctypes.c_char.from_buffer(big))
    b = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    print(a, b, flush=True)
    sys.stdin.read()
""")


def test_find_guest_ram() -> None:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        anon, memfd = map(int, p.stdout.readline().split())
        assert lc.find_guest_ram(p.pid) == (anon, anon + (64 << 20))            # the largest
        assert lc.find_guest_ram(p.pid, backing="memfd:azq-ram") == (memfd, memfd + (32 << 20))
        with pytest.raises(HostError, match=rf"^no guest RAM mapping in process {p.pid} matching 'pc.ram-nope'$"):
            lc.find_guest_ram(p.pid, backing="pc.ram-nope")
    finally:
        p.kill()
        p.wait()
    with pytest.raises(HostError, match=r"^no process 999999999$"):
        lc.read_maps(999999999)


def test_pageout_checks() -> None:
    if os.geteuid() != 0:
        with pytest.raises(lc.NotRoot):
            lc.pageout(os.getpid(), [(0, 4096)])
        return
    with pytest.raises(HostError, match="not page-aligned"):
        lc.pageout(os.getpid(), [(1, 4096)])
    # Our own private buffer, without swap: clean anonymous pages stay (nothing to write them
    # to) but the call itself is well-formed and answers with the bytes advised.
    m = mmap.mmap(-1, 1 << 20)
    m.write(b"x" * (1 << 20))
    import ctypes
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    res = lc.pageout(os.getpid(), [(start, start + (1 << 20))])
    assert res.advised_bytes == 1 << 20 and res.pid == os.getpid()


def test_memory_cgroup_of_self() -> None:
    try:
        cg = lc.memory_cgroup_of(os.getpid())
    except HostError:
        pytest.skip("no memory cgroup on this host")
    assert cg.version in (1, 2) and cg.path.is_dir()


def test_wait_ksm_converged_logic(monkeypatch: pytest.MonkeyPatch) -> None:
    # full_scans advance; pages_sharing 0 -> 500 -> 990 -> 1000 -> 1000
    seq = iter([KsmStat(full_scans=0)] + [KsmStat(full_scans=s, pages_sharing=v)
               for s, v in [(0, 0), (1, 500), (1, 500), (2, 990), (3, 1000), (4, 1000), (5, 1000)]])
    monkeypatch.setattr(lc, "read_ksm", lambda: next(seq))
    conv = lc.wait_ksm_converged(timeout_s=5, poll_s=0, tolerance_fraction=0.0)
    assert conv.converged and conv.stat.pages_sharing == 1000 and conv.full_scans == 4
    # A 1% tolerance accepts 990 -> 1000 one scan earlier.
    seq2 = iter([KsmStat(full_scans=0)] + [KsmStat(full_scans=s, pages_sharing=v)
                for s, v in [(1, 500), (2, 990), (3, 1000)]])
    monkeypatch.setattr(lc, "read_ksm", lambda: next(seq2))
    assert lc.wait_ksm_converged(timeout_s=5, poll_s=0).full_scans == 3


def test_wait_ksm_converged_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lc, "read_ksm", lambda: KsmStat(full_scans=0))
    conv = lc.wait_ksm_converged(timeout_s=0.05, poll_s=0.01)
    assert not conv.converged and conv.full_scans == 0


def test_setup_needs_root(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: tests/integration/test_linux_config.py covers set-up")
    with pytest.raises(lc.NotRoot):
        lc.LinuxConfig(record_dir=tmp_path).setup()
