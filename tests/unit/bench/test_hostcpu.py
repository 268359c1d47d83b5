"""The host's CPU over a run, split into the manager's, the QEMUs' and the rest."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from azqemu.bench import hostcpu
from azqemu.host import threads


def _burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_since_counts_the_managers_and_a_child_process_cpu() -> None:
    # A child that burns 0.3 s of CPU stands for a QEMU; this process for the manager.
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nend=time.process_time()+0.3\nwhile time.process_time()<end: pass\n"
                              "time.sleep(5)"])
    try:
        start = hostcpu.CpuSnapshot.take(os.getpid(), [child.pid])
        _burn(0.2)
        time.sleep(1.0)      # the child's burn is over by now
        got = hostcpu.CpuSnapshot.take(os.getpid(), [child.pid]).since(start)
    finally:
        child.kill()
        child.wait()
    assert got["manager_cpu_s"] >= 0.18
    assert 0.1 <= got["qemu_cpu_s"] <= 0.6
    assert got["host_cpu_busy_s"] >= got["manager_cpu_s"] + got["qemu_cpu_s"] - 0.05
    assert 0.0 < got["host_cpu_busy_share"] <= 1.0


# A child standing for a QEMU: once told (a line on its stdin), a thread named as QEMU names a
# vCPU burns 0.4 s and its main thread 0.2 s (the rest of a QEMU); then both sleep.
_QEMU_LIKE = """
import sys, threading, time
go = threading.Event()
def burn(s):
    end = time.thread_time() + s
    while time.thread_time() < end:
        pass
def vcpu():
    with open("/proc/self/task/%d/comm" % threading.get_native_id(), "w") as f:
        f.write("CPU 0/TCG")
    go.wait()
    burn(0.4)
    time.sleep(30)
threading.Thread(target=vcpu, daemon=True).start()
sys.stdin.readline()
go.set()
burn(0.2)
time.sleep(30)
"""


def test_the_qemus_vcpu_threads_are_counted_apart() -> None:
    """The vCPU threads' user and system time is split out of a QEMU's CPU; the rest of the
    process is not in it."""
    child = subprocess.Popen([sys.executable, "-c", _QEMU_LIKE], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not threads.threads_named(child.pid, "CPU ", prefix=True):    # the vCPU is named
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = hostcpu.CpuSnapshot.take(os.getpid(), [child.pid])
        assert child.pid in start.vcpu_s
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.flush()
        proc, deadline = psutil.Process(child.pid), time.monotonic() + 30
        while sum(proc.cpu_times()[:2]) < start.qemu_s[child.pid] + 0.6 - 0.03:      # both burns (about) over
            assert time.monotonic() < deadline
            time.sleep(0.05)
        got = hostcpu.CpuSnapshot.take(os.getpid(), [child.pid]).since(start)
    finally:
        child.kill()
        child.wait()
    vcpu = got["qemu_vcpu_user_s"] + got["qemu_vcpu_sys_s"]
    assert 0.35 <= vcpu <= 0.6
    assert got["qemu_cpu_s"] >= vcpu + 0.15           # the main thread's burn is QEMU's, not a vCPU's


def test_a_process_gone_counts_what_it_had() -> None:
    start = hostcpu.CpuSnapshot(10.0, 100.0, 1.0, {4242: 3.0}, {4242: (2.0, 0.5)})
    end = hostcpu.CpuSnapshot(15.0, 110.0, 2.0, {})
    got = end.since(start)
    assert got["qemu_cpu_s"] == 0.0 and got["manager_cpu_s"] == 1.0
    assert got["qemu_vcpu_user_s"] == 0.0 and got["qemu_vcpu_sys_s"] == 0.0
    assert got["other_cpu_s"] == 4.0 and got["host_cpu_busy_share"] == 0.5


def test_a_process_without_vcpu_threads_has_no_split() -> None:
    snap = hostcpu.CpuSnapshot.take(os.getpid(), [os.getpid()])
    assert snap.vcpu_s == {}                           # this process names no thread "CPU ..."


def test_note_names_each_policy() -> None:
    res = {"policies": {"agentzip": {"manager_cpu_s": 40.0, "qemu_cpu_s": 400.0, "host_cpu_busy_share": 0.97},
                        "none": {}}}
    note = hostcpu.markdown_note(res)
    assert "agentzip: manager 40.0 s, QEMUs 400.0 s, host busy 97%" in note and "none:" not in note
    res["policies"]["agentzip"].update(qemu_vcpu_user_s=350.0, qemu_vcpu_sys_s=20.5)
    assert ("agentzip: manager 40.0 s, QEMUs 400.0 s (vCPU threads 350.0 s user, 20.5 s system), host busy 97%"
            in hostcpu.markdown_note(res))


def test_note_gives_the_compression_cpu_its_loops_ran_below_the_guests() -> None:
    res = {"policies": {"agentzip": {"manager_cpu_s": 40.0, "qemu_cpu_s": 400.0, "host_cpu_busy_share": 0.97,
                                     "compress_cpu_s_total": 12.5, "compress_cpu_loops_below_s_total": 9.25},
                        "linux": {"manager_cpu_s": 30.0, "qemu_cpu_s": 410.0, "host_cpu_busy_share": 0.9,
                                  "compress_cpu_s_total": 0.0}}}
    note = hostcpu.markdown_note(res)
    assert "agentzip: manager 40.0 s (compression 12.5 s, 9.2 s of it in C loops below the guests), QEMUs" in note
    assert "linux: manager 30.0 s, QEMUs 410.0 s" in note
