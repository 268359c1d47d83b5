"""Probe whether KVM can actually run a guest, not just whether /dev/kvm exists.

Some hosts (nested or paravirtualised ones such as PVM) expose /dev/kvm but cannot run an
ordinary guest. Seen on this project's machines: a real-mode vCPU runs, SeaBIOS even boots
under ``-accel kvm``, but a Linux kernel never prints a line. So the probe has two stages:

1. the smallest possible VM through the KVM ioctl ABI (linux/kvm.h): one page of guest memory
   holding ``hlt``, one vCPU in real mode, one KVM_RUN that must end in KVM_EXIT_HLT;
2. when a guest kernel is at hand, QEMU boots it with ``-accel kvm`` and no root device: a
   usable KVM gets to the kernel's "VFS: Unable to mount root" panic within seconds.

Both run in child processes under a timeout, because on a broken host KVM_RUN may never return.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# ioctl numbers from linux/kvm.h (x86_64); _IO(0xAE, n) and _IOR/_IOW with the struct sizes.
KVM_GET_API_VERSION = 0xAE00
KVM_CREATE_VM = 0xAE01
KVM_GET_VCPU_MMAP_SIZE = 0xAE04
KVM_CREATE_VCPU = 0xAE41
KVM_SET_USER_MEMORY_REGION = 0x4020AE46   # _IOW(0xAE, 0x46, struct kvm_userspace_memory_region [32])
KVM_RUN = 0xAE80
KVM_SET_REGS = 0x4090AE82                 # _IOW(0xAE, 0x82, struct kvm_regs [144])
KVM_GET_SREGS = 0x8138AE83                # _IOR(0xAE, 0x83, struct kvm_sregs [312])
KVM_SET_SREGS = 0x4138AE84
KVM_API_VERSION = 12
KVM_EXIT_HLT = 5

# How long a healthy host needs for the whole probe is a few milliseconds; on the broken
# hosts seen here KVM_RUN never returns, so anything beyond a few seconds means unusable.
PROBE_TIMEOUT_S = 5.0
# A Linux kernel reaches its no-root panic in ~1 s under KVM and ~1.5 s under TCG here;
# 20 s leaves room for a loaded host without making doctor slow on a broken one.
KERNEL_BOOT_TIMEOUT_S = 20.0


class _MemRegion(ctypes.Structure):
    _fields_ = [("slot", ctypes.c_uint32), ("flags", ctypes.c_uint32),
                ("guest_phys_addr", ctypes.c_uint64), ("memory_size", ctypes.c_uint64),
                ("userspace_addr", ctypes.c_uint64)]


@dataclass(frozen=True)
class KvmVerdict:
    present: bool
    usable: bool
    detail: str


def _run_probe() -> int:
    """Child side: exit 0 when the vCPU halted as expected, else print why and exit 1."""
    kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    if fcntl.ioctl(kvm, KVM_GET_API_VERSION) != KVM_API_VERSION:
        print("unexpected KVM API version")
        return 1
    vm = fcntl.ioctl(kvm, KVM_CREATE_VM, 0)
    guest_mem = mmap.mmap(-1, 0x1000, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    guest_mem[0:1] = b"\xf4"  # hlt
    addr = ctypes.addressof(ctypes.c_char.from_buffer(guest_mem))
    region = _MemRegion(0, 0, 0, 0x1000, addr)
    fcntl.ioctl(vm, KVM_SET_USER_MEMORY_REGION, region)
    vcpu = fcntl.ioctl(vm, KVM_CREATE_VCPU, 0)
    run_size = fcntl.ioctl(kvm, KVM_GET_VCPU_MMAP_SIZE)
    run = mmap.mmap(vcpu, run_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    sregs = bytearray(312)
    fcntl.ioctl(vcpu, KVM_GET_SREGS, sregs)
    sregs[0:8] = (0).to_bytes(8, "little")     # cs.base (struct kvm_segment at offset 0)
    sregs[12:14] = (0).to_bytes(2, "little")   # cs.selector
    fcntl.ioctl(vcpu, KVM_SET_SREGS, bytes(sregs))
    regs = bytearray(144)
    regs[128:136] = (0).to_bytes(8, "little")  # rip (17th u64)
    regs[136:144] = (2).to_bytes(8, "little")  # rflags: bit 1 is always set
    fcntl.ioctl(vcpu, KVM_SET_REGS, bytes(regs))
    fcntl.ioctl(vcpu, KVM_RUN, 0)
    exit_reason = int.from_bytes(run[8:12], "little")  # struct kvm_run: request_interrupt_window.. exit_reason at 8
    if exit_reason != KVM_EXIT_HLT:
        print(f"vCPU exited with reason {exit_reason}, expected HLT")
        return 1
    return 0


def _probe_kernel_boot(kernel: Path, timeout_s: float) -> KvmVerdict:
    """Stage 2: does a real Linux kernel get anywhere under ``-accel kvm``?"""
    with tempfile.TemporaryDirectory(prefix="azq-kvmprobe-") as tmp:
        serial = Path(tmp) / "serial.log"
        cmd = ["qemu-system-x86_64", "-accel", "kvm", "-machine", "q35", "-cpu", "host", "-m", "256",
               "-nodefaults", "-display", "none", "-no-reboot", "-serial", f"file:{serial}",
               "-kernel", str(kernel), "-append", "console=ttyS0 panic=-1 root=/dev/azq-none"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return KvmVerdict(True, False, f"a Linux kernel printed nothing within {timeout_s:g} s "
                                           "under -accel kvm (KVM device present but not usable)")
        out = serial.read_text(errors="replace") if serial.exists() else ""
        if "Kernel panic" in out or "Unable to mount root" in out:
            return KvmVerdict(True, True, "a Linux kernel booted under -accel kvm")
        err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return KvmVerdict(True, False, f"QEMU with -accel kvm failed: {err}")


def probe_kvm(kernel: Path | None = None, timeout_s: float = PROBE_TIMEOUT_S) -> KvmVerdict:
    """Run the probes in child processes; a hang or a failure means KVM is not usable.

    ``kernel``: a Linux kernel image for the boot probe (the guest image's); without it only
    the ioctl probe runs, which some broken hosts pass.
    """
    verdict = _probe_ioctl(timeout_s)
    if verdict.usable and kernel is not None and kernel.exists():
        return _probe_kernel_boot(kernel, KERNEL_BOOT_TIMEOUT_S)
    if verdict.usable:
        return KvmVerdict(True, True, verdict.detail + " (no guest kernel yet for the boot probe)")
    return verdict


def _probe_ioctl(timeout_s: float) -> KvmVerdict:
    """Stage 1 in a child process."""
    if not os.path.exists("/dev/kvm"):
        return KvmVerdict(False, False, "/dev/kvm is absent")
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return KvmVerdict(True, False, "/dev/kvm is not accessible to this user")
    try:
        proc = subprocess.run([sys.executable, "-m", "azqemu.host.kvm"], capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return KvmVerdict(True, False, f"a test vCPU did not halt within {timeout_s:g} s")
    if proc.returncode == 0:
        return KvmVerdict(True, True, "a test vCPU ran and halted")
    why = (proc.stdout.strip() or proc.stderr.strip().splitlines()[-1:] or ["failed"])
    return KvmVerdict(True, False, f"test vCPU failed: {why if isinstance(why, str) else why[0]}")


if __name__ == "__main__":
    try:
        sys.exit(_run_probe())
    except OSError as exc:
        print(f"{exc.strerror or exc}")
        sys.exit(1)
