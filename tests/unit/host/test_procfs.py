"""procfs readers on this process and on child processes (no VM, no root)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from azqemu.errors import HostError
from azqemu.host import procfs

MIB = 1 << 20


def test_read_meminfo(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       1000 kB\nMemAvailable:    400 kB\nHugePages_Total:       3\n")
    assert procfs.read_meminfo(str(f)) == {"MemTotal": 1024000, "MemAvailable": 409600, "HugePages_Total": 3}
    real = procfs.read_meminfo()
    assert real["MemTotal"] > real["MemAvailable"] > 0


def test_vma_smaps_of_a_touched_buffer(touched_buffer: tuple[int, int]) -> None:
    start, end = touched_buffer
    vma = procfs.read_vma_smaps(os.getpid(), start, end)
    assert vma["Size"] >= 8 * MIB and vma["Rss"] >= 8 * MIB and vma["Anonymous"] >= 8 * MIB
    assert vma.get("KSM", 0) == 0 and vma["Swap"] == 0
    roll = procfs.read_smaps_rollup(os.getpid())
    assert roll["Pss_Anon"] >= 8 * MIB and roll["Rss"] >= roll["Pss"] > 0
    # An unmapped range matches nothing.
    assert procfs.read_vma_smaps(os.getpid(), 0, 4096) == {}


def test_rss_anon_counts_anonymous_memory_as_smaps_does() -> None:
    import mmap

    before = procfs.read_rss_anon(os.getpid())
    # Private: Python's default anonymous mmap is shared memory, which RssShmem counts.
    buf = mmap.mmap(-1, 16 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        for off in range(0, 16 * MIB, 4096):     # every page touched: anonymous and resident
            buf[off] = 1
        grown = procfs.read_rss_anon(os.getpid()) - before
        # The kernel's counters are batched per CPU: within a MiB of the 16 touched.
        assert 15 * MIB <= grown <= 17 * MIB
        assert abs(procfs.read_rss_anon(os.getpid()) - procfs.read_smaps_rollup(os.getpid())["Anonymous"]) < 2 * MIB
    finally:
        buf.close()
    with pytest.raises((OSError, HostError)):
        procfs.read_rss_anon(2 ** 22 + 12345)   # above pid_max's default: no such process


def test_file_allocated_bytes_of_a_memfd() -> None:
    fd = os.memfd_create("azq-test-ram")
    try:
        os.ftruncate(fd, 16 * MIB)
        os.pwrite(fd, b"x" * MIB, 4 * MIB)
        path = procfs.find_ram_fd(os.getpid(), "memfd:azq-test-ram")
        assert procfs.file_allocated_bytes(path) == MIB          # sparse: only what was written
        with pytest.raises(HostError, match=rf"^process {os.getpid()} has no open file matching 'memfd:nope'$"):
            procfs.find_ram_fd(os.getpid(), "memfd:nope")
    finally:
        os.close(fd)


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
        assert procfs.find_guest_ram(p.pid) == (anon, anon + (64 << 20))            # the largest
        assert procfs.find_guest_ram(p.pid, backing="memfd:azq-ram") == (memfd, memfd + (32 << 20))
        with pytest.raises(HostError, match=rf"^no guest RAM mapping in process {p.pid} matching 'pc.ram-nope'$"):
            procfs.find_guest_ram(p.pid, backing="pc.ram-nope")
    finally:
        p.kill()
        p.wait()
    with pytest.raises(HostError, match=r"^no process 999999999$"):
        procfs.read_maps(999999999)
