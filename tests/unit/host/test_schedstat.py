"""A process's threads' waits for a CPU, from /proc/PID/task/TID/schedstat."""

from __future__ import annotations

import os
import threading
import time

import pytest

from azqemu.host import schedstat, threads
from azqemu.host.schedstat import SchedWait

from .conftest import wait_os_threads_gone

needs_schedstat = pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"),
                                     reason="the kernel keeps no schedstat (CONFIG_SCHED_INFO)")


@needs_schedstat
def test_named_threads_are_found_and_their_waits_counted() -> None:
    """Two threads named like QEMU's vCPUs, each sleeping and waking: found by name (and no
    other thread), their times on a CPU counted, and gone threads give no figure."""
    stop = threading.Event()
    ready = threading.Barrier(3)

    def vcpu(n: int) -> None:
        threads.name_os_thread(f"CPU {n}/TCG")
        ready.wait()
        while not stop.is_set():
            time.sleep(0.001)              # a wake-up, then a new time on a CPU

    ts = [threading.Thread(target=vcpu, args=(n,)) for n in range(2)]
    for t in ts:
        t.start()
    try:
        ready.wait()
        pid = os.getpid()
        tids = threads.threads_named(pid, schedstat.VCPU_THREAD_PREFIX, prefix=True)
        assert len(tids) == 2 and threading.get_native_id() not in tids
        before = schedstat.wait_of(pid, tids)
        time.sleep(0.2)
        after = schedstat.wait_of(pid, tids)
        assert before is not None and after is not None
        assert after.slices - before.slices >= 20 and after.wait_ns >= before.wait_ns
        per = schedstat.wait_per_slice_s(before, after)
        assert per is not None and 0 <= per < 0.2
    finally:
        stop.set()
        for t in ts:
            t.join(10)
        wait_os_threads_gone(tids)
    assert schedstat.wait_of(pid, tids) is None                        # the threads are gone
    assert threads.threads_named(2**22 + 7, schedstat.VCPU_THREAD_PREFIX, prefix=True) == []   # no such process


def test_wait_per_slice() -> None:
    assert schedstat.wait_per_slice_s(SchedWait(1_000_000, 10), SchedWait(7_000_000, 13)) == pytest.approx(0.002)
    assert schedstat.wait_per_slice_s(SchedWait(5, 10), SchedWait(9, 10)) is None     # never got a CPU
    assert schedstat.wait_per_slice_s(None, SchedWait(9, 10)) is None
    assert schedstat.wait_per_slice_s(SchedWait(9, 1), None) is None
    assert schedstat.wait_of(os.getpid(), []) is None


@needs_schedstat
def test_a_qemus_vcpu_threads_are_read_by_pid() -> None:
    """vcpu_wait reads the threads named like QEMU's vCPUs of a process, and none is none."""
    assert schedstat.vcpu_wait(os.getpid()) is None          # this process has no vCPU thread
    stop = threading.Event()
    named = threading.Event()

    tid: list[int] = []

    def vcpu() -> None:
        tid.append(threading.get_native_id())
        threads.name_os_thread("CPU 0/KVM")
        named.set()
        stop.wait(10)
    t = threading.Thread(target=vcpu)
    t.start()
    try:
        named.wait(10)
        got = schedstat.vcpu_wait(os.getpid())
        assert got is not None and got.slices >= 1
    finally:
        stop.set()
        t.join(10)
        wait_os_threads_gone(tid)
