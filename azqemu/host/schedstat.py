"""How long a process's threads waited for a CPU: /proc/PID/task/TID/schedstat.

The kernel keeps, per thread (CONFIG_SCHED_INFO), the nanoseconds it ran, the nanoseconds it
waited runnable on a run queue, and how many times it was put on a CPU. A guest's vCPU thread
that blocks on a userfaultfd fault waits again for a CPU once the fault is served; on a host
whose cores are busy that wait, not the service, is most of the fault's stall. Its mean per
time on a CPU over a tool call is what the manager charges each fault on top of the service
(daemon/callkinds.py, ``prefetch_pays``).
"""

from __future__ import annotations

from dataclasses import dataclass

from azqemu.host import threads

# QEMU names its vCPU threads "CPU <n>/TCG" or "CPU <n>/KVM".
VCPU_THREAD_PREFIX = "CPU "


@dataclass(frozen=True)
class SchedWait:
    """Cumulative over some threads: nanoseconds waited runnable, times put on a CPU, and
    nanoseconds run (a paused guest's vCPU threads do not run: it is constant then)."""

    wait_ns: int
    slices: int
    run_ns: int = 0


def wait_of(pid: int, tids: list[int]) -> SchedWait | None:
    """The threads' waits summed; None when one of them is gone or the kernel keeps none."""
    wait_ns = slices = run_ns = 0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except OSError:
            return None
        if len(fields) < 3:
            return None
        run_ns += int(fields[0])
        wait_ns += int(fields[1])
        slices += int(fields[2])
    return SchedWait(wait_ns, slices, run_ns) if tids else None


def vcpu_wait(qemu_pid: int) -> SchedWait | None:
    """QEMU's vCPU threads' waits (found afresh: a listing and a few names, ~0.1 ms here)."""
    return wait_of(qemu_pid, threads.threads_named(qemu_pid, VCPU_THREAD_PREFIX, prefix=True))


def wait_per_slice_s(before: SchedWait | None, after: SchedWait | None) -> float | None:
    """Mean seconds waited for a CPU per time on one between two readings; None without
    both, or when the threads never got a CPU in between."""
    if before is None or after is None or after.slices <= before.slices:
        return None
    return max(0, after.wait_ns - before.wait_ns) / (after.slices - before.slices) / 1e9
