"""``azq doctor``: what this host can do for azqemu, one verdict a line, and what to do about it.

The rest of azqemu asks the same functions (through ``hostsetup.detect`` and ``restore_mode``)
instead of assuming: KVM where it works, TCG otherwise; lazy clones where the userfaultfd
export library is built and userfaultfd is usable, eager copies otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from azqemu import config as config_mod
from azqemu.host import setup as hostsetup

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str      # ok | warn | fail
    detail: str
    advice: str = ""


def _guest_kernel() -> Path | None:
    try:
        from azqemu.image import find_image
        return find_image().kernel
    except Exception:  # noqa: BLE001 - no image yet is a normal state for doctor
        return None


def userfaultfd_usable() -> tuple[bool, str]:
    """Root can hand /dev/userfaultfd to QEMU (DESIGN: the syscall is refused to QEMU's user)."""
    path = "/dev/userfaultfd"
    if not os.path.exists(path):
        return False, "/dev/userfaultfd is absent (kernel < 6.1 or CONFIG_USERFAULTFD off)"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
    except OSError as exc:
        return False, f"cannot open /dev/userfaultfd: {exc.strerror}"
    return True, "/dev/userfaultfd opens (the manager hands it to QEMU)"


def restore_mode() -> tuple[str, str]:
    """'lazy' (userfaultfd clones/restore) or 'eager' (copy), with the reason."""
    ok, why = userfaultfd_usable()
    lib = config_mod.load().preload_library
    if not ok:
        return "eager", why
    if not lib.exists():
        return "eager", f"export library {lib} not built (make lib)"
    return "lazy", f"userfaultfd export library {lib}"


def _module_available(name: str) -> bool:
    if Path(f"/sys/module/{name}").exists() or Path(f"/sys/class/{name}-control").exists():
        return True
    return subprocess.run(["modprobe", "-n", name], capture_output=True).returncode == 0


def run_checks(daemon: tuple[DaemonPing, str] | None = None) -> list[Check]:
    """Every check; the daemon's too when ``daemon`` gives a ping and where it is asked."""
    cfg = config_mod.load()
    checks: list[Check] = []
    facts = hostsetup.detect(_guest_kernel())
    kvm = facts.kvm
    if kvm.usable:
        checks.append(Check("kvm", OK, kvm.detail))
    elif kvm.present:
        checks.append(Check("kvm", WARN, f"/dev/kvm present but unusable: {kvm.detail}",
                            "nothing to do: TCG is used; libvirtd is started with /dev/kvm hidden"))
    else:
        checks.append(Check("kvm", WARN, kvm.detail, "load kvm_intel/kvm_amd for speed; TCG is used"))
    checks.append(Check("accelerator", OK if facts.accel == "kvm" else WARN,
                        f"{facts.accel} will be used" + ("" if facts.accel == "kvm" else
                                                         " (software emulation: slower guests)")))
    checks.append(_libvirt_check(cfg.libvirt_uri, hide_kvm=kvm.present and not kvm.usable))
    ok, why = userfaultfd_usable()
    checks.append(Check("userfaultfd", OK if ok else FAIL, why,
                        "" if ok else "lazy clones and lazy restore are off; use a kernel >= 6.1"))
    mode, why = restore_mode()
    checks.append(Check("clone-mode", OK if mode == "lazy" else WARN, f"{mode} clones: {why}",
                        "" if mode == "lazy" else "run 'make lib' to build the export library"))
    checks.append(Check("zram", OK if _module_available("zram") else WARN,
                        "zram module available" if _module_available("zram") else "no zram module",
                        "" if _module_available("zram") else "the linux policy needs zram"))
    zswap = Path("/sys/module/zswap/parameters/enabled")
    checks.append(Check("zswap", OK if zswap.exists() else WARN,
                        f"zswap present (enabled={zswap.read_text().strip()})" if zswap.exists()
                        else "zswap not built into this kernel"))
    ksm = Path("/sys/kernel/mm/ksm/run")
    checks.append(Check("ksm", OK if ksm.exists() else WARN,
                        f"KSM present (run={ksm.read_text().strip()})" if ksm.exists() else "no KSM",
                        "" if ksm.exists() else "the linux policy needs KSM (CONFIG_KSM)"))
    kernel = _guest_kernel()
    checks.append(Check("guest-image", OK if kernel else WARN,
                        f"built ({kernel.parent})" if kernel else "not built",
                        "" if kernel else "run 'azq image build'"))
    checks.append(_disk_check(cfg.state_dir))
    checks.append(_baseline_check())
    if daemon is not None:
        checks.append(daemon_check(*daemon))
    return checks


# Asks the daemon who it is: (pid, version) or an AzqemuError (the CLI passes the typed
# client's ping; the host layer does not depend on the client).
DaemonPing = Callable[[], tuple[int, str]]


def daemon_check(ping: DaemonPing, where: str) -> Check:
    """Whether the manager daemon answers on its socket, and which one (pid, version). A
    daemon that is down is a warning: the host can run one, nothing is broken."""
    from azqemu.errors import AzqemuError

    try:
        pid, version = ping()
    except AzqemuError as exc:
        return Check("daemon", WARN, str(exc).split("; start it")[0] if str(exc) else f"no answer at {where}",
                     "start it: 'azq daemon' or 'systemctl start azqemu' (docs/operations.md)")
    return Check("daemon", OK, f"azqemu {version} answers at {where} (pid {pid})")


def _baseline_check() -> Check:
    """The Linux configuration a benchmark set up must not outlive it (swap on zram takes other
    processes' pages, KSM merges them): its record still on disk means it was not torn down."""
    from azqemu.host.linuxmm import RECORD_DIR, RECORD_NAME

    record = RECORD_DIR / RECORD_NAME
    if record.exists():
        return Check("baseline", WARN, f"the Linux configuration of a benchmark is still set up ({record})",
                     "run 'azq host recover' (unless a benchmark runs now)")
    return Check("baseline", OK, "no Linux-configuration settings left behind")


def _libvirt_check(uri: str, *, hide_kvm: bool) -> Check:
    from azqemu.errors import LibvirtUnavailable
    from azqemu.virt.host import Host  # the virt layer owns libvirt

    try:
        with Host(uri) as host:
            ver = host.version()
    except LibvirtUnavailable as exc:
        return Check("libvirtd", FAIL, f"no answer at {uri}: {exc}",
                     "run 'azq host setup' (starts virtlogd and libvirtd)")
    procs = hostsetup._procs("libvirtd")
    if hide_kvm and procs and not all(hostsetup.libvirtd_hides_kvm(p) for p in procs):
        return Check("libvirtd", WARN, f"libvirt {ver} answers but sees the unusable /dev/kvm "
                     "(each domain start takes ~72 s)", "run 'azq host setup --restart'")
    return Check("libvirtd", OK, f"libvirt {ver} answers at {uri}")


def _disk_check(state_dir: Path) -> Check:
    probe = state_dir if state_dir.exists() else state_dir.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    verdict = OK if free > 4 << 30 else WARN
    return Check("state-dir", verdict, f"{state_dir}: {free >> 30} GiB free",
                 "" if verdict == OK else "templates need ~RAM size each; free some space")
