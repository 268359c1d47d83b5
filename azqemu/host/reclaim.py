"""Proactive reclaim: push a process's pages out to swap, by madvise or by memory cgroup.

The Linux configuration's third lever (after KSM and zram): an idle sandbox's guest RAM is
pushed out proactively, because waiting for memory pressure would leave it resident.
``pageout`` uses process_madvise(MADV_PAGEOUT) on QEMU's guest-RAM mapping; ``cgroup_reclaim``
asks a memory cgroup to shrink (memory.reclaim on v2, a lowered limit on v1).
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from azqemu.errors import HostError, NotRoot
from azqemu.host.linuxmm import read_knob, write_knob
from azqemu.host.procfs import find_guest_ram
from azqemu.pages import PAGE_SIZE

# --- kernel ABI used by pageout() ---------------------------------------------------------
# process_madvise(2): syscall number 440 on x86_64 (arch/x86/entry/syscalls/syscall_64.tbl)
# and in the generic table (aarch64, riscv64); Linux >= 5.10. pidfd_open(2) is syscall 434,
# called through os.pidfd_open(). MADV_PAGEOUT = 21 and MADV_COLD = 20 come from
# include/uapi/asm-generic/mman-common.h (Linux >= 5.4). The caller needs CAP_SYS_NICE and
# PTRACE_MODE_READ over the target (root has both).
SYS_PROCESS_MADVISE = {"x86_64": 440, "aarch64": 440, "riscv64": 440}


MADV_COLD = 20


MADV_PAGEOUT = 21


MADV_MERGEABLE = 12


# process_madvise() handles at most MAX_RW_COUNT (INT_MAX rounded down to a page) per call.
PAGEOUT_CHUNK_BYTES = 1 << 30


class _Iovec(ctypes.Structure):
    # struct iovec {void *iov_base; size_t iov_len;} (include/uapi/linux/uio.h)
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


@dataclass(frozen=True)
class PageoutResult:
    pid: int
    advised_bytes: int
    elapsed_s: float
    rss_before_bytes: int
    rss_after_bytes: int


def _process_madvise(pidfd: int, ranges: list[tuple[int, int]], advice: int) -> int:
    machine = os.uname().machine
    nr = SYS_PROCESS_MADVISE.get(machine)
    if nr is None:
        raise HostError(f"process_madvise: syscall number unknown on {machine}")
    pieces: list[tuple[int, int]] = []
    for start, end in ranges:
        if start % PAGE_SIZE or end % PAGE_SIZE or end <= start:
            raise HostError(f"pageout range {start:#x}-{end:#x} is not page-aligned and non-empty")
        for s in range(start, end, PAGEOUT_CHUNK_BYTES):
            pieces.append((s, min(end, s + PAGEOUT_CHUNK_BYTES)))
    total = 0
    # One call per iovec: the kernel stops at the first range it cannot advise and reports
    # only the bytes before it, so per-range calls keep the accounting exact.
    for s, e in pieces:
        done = s
        while done < e:
            iov = (_Iovec * 1)(_Iovec(done, e - done))
            ret = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(pidfd), iov, ctypes.c_size_t(1),
                                ctypes.c_int(advice), ctypes.c_uint(0))
            if ret < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise HostError(f"process_madvise({advice}) of {done:#x}-{e:#x} failed: {os.strerror(err)}")
            if ret == 0:
                break
            done += ret
            total += ret
    return total


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pageout(pid: int, ranges: list[tuple[int, int]] | None = None, *, backing: str | None = None,
            advice: int = MADV_PAGEOUT) -> PageoutResult:
    """Push a process's pages (by default QEMU's guest RAM) out to swap (zram) or, for clean
    file pages, drop them: process_madvise(pidfd, ranges, MADV_PAGEOUT)."""
    if os.geteuid() != 0:
        raise NotRoot("process_madvise(MADV_PAGEOUT) of another process")
    if ranges is None:
        ranges = [find_guest_ram(pid, backing)]
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        raise HostError(f"no process {pid}") from None
    try:
        before = _rss_bytes(pid)
        t0 = time.perf_counter()
        advised = _process_madvise(pidfd, ranges, advice)
        elapsed = time.perf_counter() - t0
        return PageoutResult(pid, advised, elapsed, before, _rss_bytes(pid))
    finally:
        os.close(pidfd)


@dataclass(frozen=True)
class MemoryCgroup:
    version: int       # 1 or 2
    path: Path         # the cgroup's directory


def memory_cgroup_of(pid: int) -> MemoryCgroup:
    """The memory cgroup a process is charged to (v2 if the unified hierarchy has the memory
    controller, else v1). This host: v1 memory controller, a v2 hierarchy without it."""
    v1_root = Path("/sys/fs/cgroup/memory")
    v2_roots = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")]
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        hid, controllers, rel = line.split(":", 2)
        if hid == "0" and controllers == "":
            for root in v2_roots:
                try:
                    if "memory" in read_knob(root / "cgroup.controllers").split():
                        return MemoryCgroup(2, root / rel.lstrip("/"))
                except OSError:
                    continue
        elif "memory" in controllers.split(","):
            return MemoryCgroup(1, v1_root / rel.lstrip("/"))
    raise HostError(f"process {pid} has no memory cgroup (neither v1 nor v2 memory controller)")


def cgroup_reclaim(cg: MemoryCgroup, nbytes: int) -> int:
    """Reclaim about nbytes from a memory cgroup; return the bytes its usage dropped by.

    v2: memory.reclaim (Linux >= 5.19). v1 has no such file: lower memory.limit_in_bytes to
    usage - nbytes (the kernel reclaims until usage fits, or refuses with EBUSY and changes
    nothing), then put the old limit back. Known race: a task of the cgroup that allocates
    during those few milliseconds meets the lower limit and reclaims too; it is not OOM-killed
    while swap has room. A v1 cgroup only holds what was charged inside it: QEMU must start in
    the cgroup (libvirt does that); v1 does not move charges with a task.
    """
    if cg.version == 2:
        before = int(read_knob(cg.path / "memory.current"))
        try:
            write_knob(cg.path / "memory.reclaim", nbytes)
        except HostError as err:
            if not isinstance(err.__cause__, OSError) or err.__cause__.errno != errno.EAGAIN:
                raise   # EAGAIN: reclaimed less than asked, which is fine here
        return max(0, before - int(read_knob(cg.path / "memory.current")))
    usage_file, limit_file = cg.path / "memory.usage_in_bytes", cg.path / "memory.limit_in_bytes"
    before = int(read_knob(usage_file))
    old_limit = read_knob(limit_file)
    target = max(PAGE_SIZE, (before - nbytes) // PAGE_SIZE * PAGE_SIZE)
    try:
        write_knob(limit_file, target)
    except HostError as err:
        if not isinstance(err.__cause__, OSError) or err.__cause__.errno != errno.EBUSY:
            raise
    finally:
        write_knob(limit_file, old_limit)
    return max(0, before - int(read_knob(usage_file)))
