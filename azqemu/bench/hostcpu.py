"""Where the host's CPU went during one policy's run: the manager, the guests' QEMUs, the rest.

On a host with more guests than cores the tool calls are as fast as the CPU the guests get:
a policy whose manager spends CPU (compressions, trims, faults) slows every guest down by as
much, which no part of a tool call's own time shows (toolcalls.py). Measured from outside
the manager (psutil: /proc/stat and the processes' own times), over the workload only.

The QEMUs' part is split further: their vCPU threads' user and system time (the guest's own
work under TCG, and the host's page faults on guest memory: copy-on-write copies, userfaultfd
faults) against the rest (device emulation, the monitor, libvirt's requests). A policy that
drops and brings back guest pages shows there what its faults cost the guests' threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psutil

from azqemu.host import threads
from azqemu.host.schedstat import VCPU_THREAD_PREFIX


def _process_cpu_s(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
    return float(t.user + t.system)


def _vcpu_cpu_s(pid: int) -> tuple[float, float] | None:
    """User and system CPU seconds of a QEMU's vCPU threads together; None when it has none
    (gone, or not a QEMU)."""
    vcpus = set(threads.threads_named(pid, VCPU_THREAD_PREFIX, prefix=True))
    try:
        times = [t for t in psutil.Process(pid).threads() if t.id in vcpus] if vcpus else []
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if not times:
        return None
    return sum(t.user_time for t in times), sum(t.system_time for t in times)


@dataclass(frozen=True)
class CpuSnapshot:
    host_busy_s: float       # every core's non-idle time since boot (idle and iowait left out)
    host_total_s: float
    manager_s: float
    qemu_s: dict[int, float]
    vcpu_s: dict[int, tuple[float, float]] = field(default_factory=dict)   # (user, system) a QEMU

    @classmethod
    def take(cls, manager_pid: int, qemu_pids: list[int]) -> CpuSnapshot:
        t = psutil.cpu_times()
        idle = t.idle + getattr(t, "iowait", 0.0)
        # guest and guest_nice are already inside user and nice (proc(5)): not added again.
        total = t.user + t.nice + t.system + idle + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) \
            + getattr(t, "steal", 0.0)
        vcpu = {p: v for p in qemu_pids if (v := _vcpu_cpu_s(p)) is not None}
        return cls(float(total - idle), float(total), _process_cpu_s(manager_pid),
                   {p: _process_cpu_s(p) for p in qemu_pids}, vcpu)

    def since(self, start: CpuSnapshot) -> dict[str, float]:
        """CPU seconds between ``start`` and this snapshot: host busy, the manager's, the
        QEMUs' and of it their vCPU threads' user and system time (a QEMU that exited meanwhile
        counts as what it had at ``start``), and the host's busy share of its cores."""
        total = self.host_total_s - start.host_total_s
        qemu = sum(self.qemu_s.get(p, v) - v for p, v in start.qemu_s.items())
        vcpu_user = vcpu_sys = 0.0
        for p, (u0, s0) in start.vcpu_s.items():
            u1, s1 = self.vcpu_s.get(p, (u0, s0))
            vcpu_user += max(0.0, u1 - u0)
            vcpu_sys += max(0.0, s1 - s0)
        busy = self.host_busy_s - start.host_busy_s
        return {"host_cpu_busy_s": busy, "manager_cpu_s": self.manager_s - start.manager_s,
                "qemu_cpu_s": qemu, "qemu_vcpu_user_s": vcpu_user, "qemu_vcpu_sys_s": vcpu_sys,
                "other_cpu_s": busy - (self.manager_s - start.manager_s) - qemu,
                "host_cpu_busy_share": busy / total if total > 0 else float("nan")}


def _below(p: dict[str, Any]) -> str:
    """Of a compressing policy's compression CPU, what its C loops ran below the guests while
    the rest ran above them (AZQ_COMPRESS_LOOPS_BELOW=1; else the whole worker runs below)."""
    total, below = p.get("compress_cpu_s_total") or 0.0, p.get("compress_cpu_loops_below_s_total") or 0.0
    return f" (compression {total:.1f} s, {below:.1f} s of it in C loops below the guests)" if below > 0 else ""


def _vcpus(p: dict[str, Any]) -> str:
    """Of the QEMUs' CPU, their vCPU threads' user and system time, where measured."""
    if "qemu_vcpu_user_s" not in p:
        return ""
    return f" (vCPU threads {p['qemu_vcpu_user_s']:.1f} s user, {p['qemu_vcpu_sys_s']:.1f} s system)"


def markdown_note(result: dict[str, Any]) -> str:
    """One line: each policy's CPU over its workload (manager, QEMUs, busy share of the host)."""
    parts = [f"{name}: manager {p['manager_cpu_s']:.1f} s{_below(p)}, QEMUs {p['qemu_cpu_s']:.1f} s{_vcpus(p)}, "
             f"host busy {p['host_cpu_busy_share']:.0%}"
             for name, p in result["policies"].items() if "manager_cpu_s" in p]
    return ("Host CPU over the workload (a manager's CPU is taken from the guests when they "
            "outnumber the cores): " + "; ".join(parts) + ".") if parts else ""
