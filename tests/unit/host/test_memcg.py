"""The fill check's memory cgroup, on the real kernel: a limit, usage, OOM kills, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from azqemu.errors import HostError
from azqemu.host import memcg
from azqemu.host.memcg import MemoryCgroup

MIB = 1 << 20
# A child that allocates and touches N MiB when told (a line on stdin), then waits.
HOG = ("import sys\nsys.stdin.readline()\nb = bytearray(int(sys.argv[1]) << 20)\n"
       "for i in range(0, len(b), 4096): b[i] = 1\nprint('held', flush=True)\nsys.stdin.readline()\n")


def _cgroups_available() -> bool:
    try:
        MemoryCgroup(f"azq-test-probe-{os.getpid()}", 64 * MIB).close()
        return True
    except HostError:
        return False


pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not _cgroups_available(),
                                reason="needs root and a memory cgroup controller")


def _swap_active() -> bool:
    with open("/proc/swaps") as f:
        return len(f.read().splitlines()) > 1


@pytest.fixture
def hog() -> Iterator[Callable[[int], subprocess.Popen[str]]]:
    """Start children that allocate N MiB when told; every one is killed at teardown."""
    started: list[subprocess.Popen[str]] = []

    def start(mib: int) -> subprocess.Popen[str]:
        started.append(subprocess.Popen([sys.executable, "-c", HOG, str(mib)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True))
        return started[-1]
    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _go(p: subprocess.Popen[str], wait_held: bool = True) -> None:
    """Tell the child to allocate; wait until it holds the memory."""
    assert p.stdin and p.stdout
    p.stdin.write("go\n")
    p.stdin.flush()
    if wait_held:
        assert p.stdout.readline().strip() == "held"


def _origin(pid: int, version: int) -> str:
    return memcg._own_cgroup(pid, version)


def test_usage_is_charged_after_the_move_and_the_process_goes_back(hog) -> None:
    p = hog(32)
    cg = MemoryCgroup(f"azq-test-{os.getpid()}", 512 * MIB)
    before = _origin(p.pid, cg.version)
    try:
        cg.add(p.pid)
        assert cg.pids() == [p.pid]
        assert _origin(p.pid, cg.version) == "/" + cg.path.name
        _go(p)
        assert cg.usage_bytes() >= 32 * MIB
        assert cg.oom_kills() == 0
    finally:
        cg.close()
    assert not cg.path.exists()
    assert _origin(p.pid, cg.version) == before
    assert p.poll() is None


@pytest.mark.skipif(_swap_active(), reason="swap is on: the child would swap, not be killed")
def test_a_process_over_the_limit_is_oom_killed_and_counted(hog) -> None:
    p = hog(256)
    with MemoryCgroup(f"azq-test-oom-{os.getpid()}", 64 * MIB) as cg:
        cg.add(p.pid)
        _go(p, wait_held=False)
        assert p.wait(60) == -9
        deadline = time.monotonic() + 5
        while cg.oom_kills() == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cg.oom_kills() == 1
    assert not cg.path.exists()


@pytest.mark.skipif(_swap_active(), reason="swap is on: the kernel could swap instead of refusing")
def test_a_limit_below_what_cannot_be_reclaimed_is_refused_on_v1(hog) -> None:
    p = hog(64)
    with MemoryCgroup(f"azq-test-busy-{os.getpid()}", 512 * MIB) as cg:
        if cg.version != 1:
            pytest.skip("v2 takes any limit (and reclaims or OOM-kills)")
        cg.add(p.pid)
        _go(p)
        assert cg.set_limit(16 * MIB) is False
        assert cg.limit_bytes == 512 * MIB and p.poll() is None
        assert cg.set_limit(1024 * MIB) is True


def test_bad_limits_and_names_leave_nothing() -> None:
    with pytest.raises(HostError, match="must be positive"):
        MemoryCgroup(f"azq-test-bad-{os.getpid()}", 0)
    cg = MemoryCgroup(f"azq-test-dup-{os.getpid()}", 64 * MIB)
    try:
        with pytest.raises(HostError, match="cannot create"):
            MemoryCgroup(cg.path.name, 64 * MIB)
    finally:
        cg.close()
    assert not cg.path.exists()
    with pytest.raises(HostError, match="cannot move process"):
        with MemoryCgroup(f"azq-test-nopid-{os.getpid()}", 64 * MIB) as cg2:
            cg2.add(2**22 + 12345)
    assert not cg2.path.exists()
