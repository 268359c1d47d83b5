"""The Linux configuration on the real host (root): set-up, exact restore, KSM, zram pageout.

No VM: child processes stand in for QEMU (a private anonymous buffer is what KSM and
MADV_PAGEOUT see of a share=off clone's RAM). Every test leaves the host as it found it; the
module fixture checks that at the end, even when a test failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from azqemu.host import linuxmm, memacct, procfs, reclaim
from azqemu.host.linuxmm import HostSnapshot, LinuxConfig

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root"),
    pytest.mark.skipif(not memacct.KSM_DIR.is_dir(), reason="no KSM in this kernel"),
    pytest.mark.timeout(300),
]

BUF_BYTES = 32 << 20
PAGES = BUF_BYTES // 4096

# A child that maps private anonymous buffers, fills them, reports their addresses, and then
# obeys one-word commands on stdin: "check" (print the buffers' sha256), "exit".
CHILD = textwrap.dedent("""
    import ctypes, hashlib, mmap, os, sys
    n, count, mergeable = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    # Half random, half zero per page: compressible like guest memory, and no page is all-zero.
    page = lambda: os.urandom(2048) + bytes(2048)
    pattern = b"".join(page() for _ in range(n // 4096))
    bufs = []
    for _ in range(count):
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        m.write(pattern)
        if mergeable:
            m.madvise(mmap.MADV_MERGEABLE)
        bufs.append(m)
    expect = hashlib.sha256(pattern).hexdigest()
    del pattern
    addrs = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in bufs]
    print(expect, *addrs, flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            print(*[hashlib.sha256(m[:]).hexdigest() for m in bufs], flush=True)
        elif line.strip() == "dirty":
            for m in bufs:
                m[0:1] = m[0:1]          # a write: breaks a KSM page back into a private copy
            print("ok", flush=True)
        else:
            break
""")


class Child:
    def __init__(self, count: int = 1, mergeable: bool = False, preexec: object = None) -> None:
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, str(BUF_BYTES), str(count), "1" if mergeable else "0"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  preexec_fn=preexec)  # type: ignore[arg-type]
        assert self.p.stdout is not None
        first = self.p.stdout.readline().split()
        self.expect = first[0]
        self.addrs = [int(a) for a in first[1:]]

    @property
    def pid(self) -> int:
        return self.p.pid

    def ask(self, cmd: str) -> list[str]:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().split()

    def vma(self, k: int = 0) -> dict[str, int]:
        return procfs.read_vma_smaps(self.pid, self.addrs[k], self.addrs[k] + BUF_BYTES)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


@pytest.fixture(scope="module")
def host_before() -> Iterator[HostSnapshot]:
    LinuxConfig.recover()             # a run that crashed before this one
    snap = HostSnapshot.take()
    yield snap
    # However the tests ended, the host must be what it was.
    LinuxConfig.recover()
    assert snap.diff(HostSnapshot.take()) == []


@pytest.fixture(scope="module")
def linux(host_before: HostSnapshot) -> Iterator[LinuxConfig]:
    with LinuxConfig(zram_disksize_bytes=256 << 20) as cfg:
        yield cfg


def test_setup_and_teardown_restore_the_host_exactly(host_before: HostSnapshot) -> None:
    before = HostSnapshot.take()
    swaps_before = linuxmm.read_swaps()
    with LinuxConfig(zram_disksize_bytes=64 << 20) as cfg:
        during = HostSnapshot.take()
        assert cfg.zram_device is not None and cfg.zram_device not in before.zram
        assert cfg.algorithm == "lzo-rle"
        swap = next(s for s in linuxmm.read_swaps() if s.name == f"/dev/{cfg.zram_device}")
        assert swap.size_kib >= 60 << 10 and swap.priority >= linuxmm.ZRAM_SWAP_PRIORITY
        assert during.ksm["run"] == "1" and during.ksm["use_zero_pages"] == "1"
        assert during.ksm["pages_to_scan"] == str(linuxmm.KSM_PAGES_TO_SCAN)
        assert during.sysctl["swappiness"] == str(linuxmm.SWAPPINESS)
        assert during.zswap.get("enabled", "N") == "N"
        assert cfg.record_path.exists()
        # Only one configuration at a time.
        with pytest.raises(procfs.HostError, match="another azqemu Linux configuration is active"):
            LinuxConfig().setup()
    after = HostSnapshot.take()
    assert before.diff(after) == []
    assert linuxmm.read_swaps() == swaps_before
    assert not cfg.record_path.exists()


def test_recover_after_a_crash(host_before: HostSnapshot, tmp_path: Path) -> None:
    """A process that set up and died (SIGKILL) leaves a record; recover() restores the host."""
    script = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from azqemu.host.linuxmm import LinuxConfig
        cfg = LinuxConfig(zram_disksize_bytes=32 << 20, record_dir=Path({str(tmp_path)!r}))
        cfg.setup()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    before = HostSnapshot.take()
    r = subprocess.run([sys.executable, "-c", script])
    assert r.returncode == -9
    try:
        assert (tmp_path / linuxmm.RECORD_NAME).exists()
        assert HostSnapshot.take().diff(before) != []
    finally:
        assert LinuxConfig.recover(tmp_path) is True
    assert before.diff(HostSnapshot.take()) == []
    assert LinuxConfig.recover(tmp_path) is False


def test_doctor_warns_and_host_recover_restores(host_before: HostSnapshot) -> None:
    """A benchmark killed with SIGKILL leaves its settings: doctor says so, 'azq host recover'
    puts the host back (the record in /run, where benchmarks write it)."""
    script = textwrap.dedent("""
        import os, signal
        from azqemu.host.linuxmm import LinuxConfig
        LinuxConfig(zram_disksize_bytes=32 << 20).setup()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    before = HostSnapshot.take()
    assert subprocess.run([sys.executable, "-c", script]).returncode == -9
    try:
        doc = subprocess.run([sys.executable, "-m", "azqemu", "doctor", "--json"], capture_output=True, text=True)
        baseline = next(c for c in json.loads(doc.stdout) if c["name"] == "baseline")
        assert baseline["verdict"] == "warn" and "azq host recover" in baseline["advice"]
    finally:
        r = subprocess.run([sys.executable, "-m", "azqemu", "host", "recover"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("Linux configuration restored"), r.stderr
    assert before.diff(HostSnapshot.take()) == []
    r = subprocess.run([sys.executable, "-m", "azqemu", "host", "recover"], capture_output=True, text=True)
    assert (r.returncode, r.stdout.strip()) == (0, "nothing to recover")


def test_sigterm_tears_down(host_before: HostSnapshot, tmp_path: Path) -> None:
    """A benchmark killed politely (SIGTERM) restores the host itself, no recover() needed."""
    script = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from azqemu.host.linuxmm import LinuxConfig, signals_raise
        with signals_raise(), LinuxConfig(zram_disksize_bytes=32 << 20, record_dir=Path({str(tmp_path)!r})):
            print("ready", flush=True)
            time.sleep(60)
    """)
    before = HostSnapshot.take()
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        assert HostSnapshot.take().diff(before) != []
        p.terminate()
        assert p.wait(60) == 128 + 15
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        LinuxConfig.recover(tmp_path)
    assert not (tmp_path / linuxmm.RECORD_NAME).exists()
    assert before.diff(HostSnapshot.take()) == []


def test_ksm_merges_identical_private_buffers(linux: LinuxConfig) -> None:
    child = Child(count=2, mergeable=True)
    try:
        deadline = time.monotonic() + 60
        merged = 0
        while time.monotonic() < deadline:
            merged = int(Path(f"/proc/{child.pid}/ksm_merging_pages").read_text())
            if merged >= 2 * PAGES * 0.95:
                break
            time.sleep(0.2)
        # Both buffers point at one set of KSM pages: 2 x 8192 merging pages in the process.
        assert merged >= 2 * PAGES * 0.95, merged
        conv = linuxmm.wait_ksm_converged(timeout_s=60)
        assert conv.converged and conv.full_scans >= 2
        a, b = child.vma(0), child.vma(1)
        assert a["KSM"] >= BUF_BYTES * 0.95 and b["KSM"] >= BUF_BYTES * 0.95
        # Accounting: the two buffers own ~one buffer's worth between them.
        owned = memacct.linux_owned_bytes(a, memacct.read_ksm(), {}) + memacct.linux_owned_bytes(b, memacct.read_ksm(), {})
        assert owned < BUF_BYTES * 1.3, owned / BUF_BYTES
        # Data intact, and a write breaks sharing only where it writes.
        assert child.ask("check") == [child.expect, child.expect]
        assert child.ask("dirty") == ["ok"]
        assert child.ask("check") == [child.expect, child.expect]
    finally:
        child.close()


def test_pageout_through_zram_and_back(linux: LinuxConfig) -> None:
    child = Child(count=1)
    try:
        before = child.vma()
        assert before["Rss"] >= BUF_BYTES * 0.99
        zram0 = linux.zram_stat()
        res = reclaim.pageout(child.pid, [(child.addrs[0], child.addrs[0] + BUF_BYTES)])
        assert res.advised_bytes == BUF_BYTES
        after = child.vma()
        assert after["Rss"] <= BUF_BYTES * 0.02, after
        assert after["Swap"] >= BUF_BYTES * 0.98, after
        zram1 = linux.zram_stat()
        stored = zram1["orig_data_size"] - zram0["orig_data_size"]
        assert stored >= BUF_BYTES * 0.98
        # Half of every page is zero: lzo-rle must at least halve it (plus allocator overhead).
        assert zram1["compr_data_size"] - zram0["compr_data_size"] < stored * 0.6
        # The accounting charges the swapped pages at zram's ratio.
        owned = memacct.linux_owned_bytes(after, memacct.read_ksm(), zram1)
        assert owned < BUF_BYTES * 0.7
        # Touch it again: every byte comes back.
        assert child.ask("check") == [child.expect]
        assert child.vma()["Rss"] >= BUF_BYTES * 0.99
    finally:
        child.close()


def test_find_guest_ram_and_default_pageout(linux: LinuxConfig) -> None:
    child = Child(count=1)
    try:
        start, end = procfs.find_guest_ram(child.pid)
        assert (start, end) == (child.addrs[0], child.addrs[0] + BUF_BYTES)
        res = reclaim.pageout(child.pid)              # finds the range itself
        assert res.advised_bytes == BUF_BYTES and res.rss_after_bytes < res.rss_before_bytes - BUF_BYTES // 2
        assert child.ask("check") == [child.expect]
    finally:
        child.close()


def test_cgroup_reclaim(linux: LinuxConfig) -> None:
    v1 = Path("/sys/fs/cgroup/memory")
    if not (v1 / "memory.limit_in_bytes").exists():
        pytest.skip("no cgroup v1 memory controller (v2 memory.reclaim is the path there)")
    cg_dir = v1 / f"azq-test-{os.getpid()}"
    cg_dir.mkdir()
    try:
        procs = cg_dir / "cgroup.procs"
        # The child joins the cgroup before it allocates: v1 charges stay where they were made.
        child = Child(count=1, preexec=lambda: procs.write_text(str(os.getpid())))
        try:
            cg = reclaim.memory_cgroup_of(child.pid)
            assert cg == reclaim.MemoryCgroup(1, cg_dir)
            usage = int((cg_dir / "memory.usage_in_bytes").read_text())
            assert usage >= BUF_BYTES
            limit_before = (cg_dir / "memory.limit_in_bytes").read_text()
            dropped = reclaim.cgroup_reclaim(cg, 16 << 20)
            assert dropped >= 8 << 20, dropped
            assert (cg_dir / "memory.limit_in_bytes").read_text() == limit_before
            assert child.ask("check") == [child.expect]
        finally:
            child.close()
    finally:
        for _ in range(50):
            try:
                cg_dir.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_process_madvise_abi() -> None:
    assert os.uname().machine in reclaim.SYS_PROCESS_MADVISE
    assert (reclaim.MADV_COLD, reclaim.MADV_PAGEOUT, reclaim.MADV_MERGEABLE) == (20, 21, 12)
    assert hashlib  # (keeps the import for the child's protocol documentation)
