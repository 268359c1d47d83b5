"""Host set-up: libvirt's configuration and daemons, started the way this kind of host needs.

There is no systemd on the machines azqemu is developed on, so virtlogd and libvirtd are
started here when they are not running. When /dev/kvm exists but cannot run guests, libvirtd
probes it at every domain start and each start then takes ~72 s; libvirtd is then started in a
private mount namespace where /dev/kvm is hidden behind an empty file, and QEMU's own mount
namespace is turned off (``namespaces = [ ]``) so that domains start in ~0.35 s under TCG.
Where KVM works, libvirtd starts plainly and domains use it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from azqemu import config as config_mod
from azqemu.errors import HostError, NotRoot
from azqemu.host.files import write_atomic
from azqemu.host.kvm import KvmVerdict, probe_kvm
from azqemu.virt import cowhook

log = logging.getLogger(__name__)

QEMU_CONF = Path("/etc/libvirt/qemu.conf")
CONF_MARK = "# --- azqemu (managed block) ---"
CONF_END = "# --- end azqemu ---"
CONF_BLOCK = f"""{CONF_MARK}
# QEMU's per-domain mount namespace is off: azqemu passes sockets and RAM files by path.
namespaces = [ ]
# File-backed guest RAM (copy-on-write clones, see azqemu/virt/cowhook.py) lives here.
memory_backing_dir = "{cowhook.MEMORY_BACKING_DIR}"
{CONF_END}
"""
HIDDEN_KVM_FILE = Path("/run/azqemu/empty-kvm")
LIBVIRTD_START_TIMEOUT_S = 30.0
LIBVIRTD_LOG = Path("/var/log/azqemu/libvirtd.out")


@dataclass(frozen=True)
class HostFacts:
    """What the rest of azqemu must know about the host, found once by probing."""

    kvm: KvmVerdict
    accel: str           # "kvm" or "tcg"
    libvirt_type: str    # libvirt domain type: "kvm" or "qemu"


def facts_path() -> Path:
    return config_mod.load().run_dir / "host.json"


def detect(kernel: Path | None = None, *, refresh: bool = False) -> HostFacts:
    """Probe KVM (cached in the run dir, which a reboot clears) and choose the accelerator."""
    path = facts_path()
    if not refresh and path.exists():
        try:
            raw = json.loads(path.read_text())
            verdict = KvmVerdict(**raw["kvm"])
            # A cached verdict from the ioctl-only probe is refined once a kernel exists.
            if not (kernel and verdict.usable and "no guest kernel" in verdict.detail):
                return HostFacts(verdict, raw["accel"], raw["libvirt_type"])
        except (ValueError, KeyError, TypeError):
            pass
    verdict = probe_kvm(kernel)
    facts = HostFacts(verdict, "kvm" if verdict.usable else "tcg", "kvm" if verdict.usable else "qemu")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"kvm": asdict(verdict), "accel": facts.accel,
                                    "libvirt_type": facts.libvirt_type}))
    except OSError:
        pass
    return facts


def _procs(name: str) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == name]


def libvirtd_hides_kvm(proc: psutil.Process) -> bool:
    """True if a running libvirtd sees the empty file instead of /dev/kvm."""
    try:
        st = os.stat(f"/proc/{proc.pid}/root/dev/kvm")
    except OSError:
        return True
    return not (st.st_mode & 0o170000 == 0o020000)  # not a character device any more


def configure_libvirt() -> bool:
    """Add azqemu's block to qemu.conf once; True if the file changed (libvirtd must restart)."""
    text = QEMU_CONF.read_text()
    if CONF_BLOCK in text:
        return False
    if CONF_MARK in text:
        # An older azqemu block: replace it whole.
        start = text.index(CONF_MARK)
        end = text.find(CONF_END, start)
        end = len(text) if end < 0 else text.index("\n", end) + 1 if "\n" in text[end:] else len(text)
        text = text[:start].rstrip("\n") + "\n" + text[end:]
    else:
        for key in ("namespaces", "memory_backing_dir"):
            if re.search(rf"^\s*{key}\s*=", text, re.M):
                raise HostError(f"{QEMU_CONF} already sets '{key}'; remove it so azqemu can manage it")
    write_atomic(QEMU_CONF, text.rstrip("\n") + "\n\n" + CONF_BLOCK)
    return True


def unconfigure_libvirt() -> bool:
    """Remove azqemu's block from qemu.conf; True if the file changed (libvirtd must restart)."""
    text = QEMU_CONF.read_text()
    if CONF_MARK not in text:
        return False
    start = text.index(CONF_MARK)
    end = text.find(CONF_END, start)
    end = len(text) if end < 0 else end + len(CONF_END)
    rest = text[end:].lstrip("\n")
    write_atomic(QEMU_CONF, text[:start].rstrip("\n") + "\n" + (("\n" + rest) if rest else ""))
    return True


def recover_host(*, setup: bool = False) -> list[str]:
    """Put back what azqemu changed on this host; returns what was done.

    Always: the Linux configuration a benchmark set up (swap on zram, KSM, sysctls), from the
    record it wrote before changing anything (a benchmark killed with SIGKILL leaves it). With
    ``setup``: also what ``azq host setup`` changed in libvirt's configuration (azqemu's block in
    qemu.conf, the copy-on-write hook), refused while azqemu's domains run (their RAM depends on
    both); libvirtd must then be restarted to forget them.
    """
    from azqemu.host.linuxmm import RECORD_DIR, RECORD_NAME, LinuxConfig

    if os.geteuid() != 0:
        raise NotRoot("azq host recover")
    done: list[str] = []
    if LinuxConfig.recover():
        done.append(f"Linux configuration restored from {RECORD_DIR / RECORD_NAME}")
    if setup:
        from azqemu.virt.host import Host

        with Host.wait(config_mod.load().libvirt_uri, LIBVIRTD_START_TIMEOUT_S) as host:
            ours = [d.name for d in host.domains() if d.metadata().get("role")]
        if ours:
            raise HostError(f"azqemu domains still run ({', '.join(sorted(ours)[:5])}); destroy them first")
        if unconfigure_libvirt():
            done.append(f"removed azqemu's block from {QEMU_CONF} (restart libvirtd)")
        if cowhook.remove_hook():
            done.append(f"removed {cowhook.HOOK_PATH} (restart libvirtd)")
    return done


def _wait_libvirt(uri: str, timeout_s: float) -> None:
    from azqemu.virt.host import Host  # the virt layer owns libvirt

    Host.wait(uri, timeout_s).close()


def _start_libvirtd(hide_kvm: bool) -> None:
    """Start libvirtd in the background under ``tini -s`` (a child subreaper).

    libvirt double-forks QEMU, so a stopped QEMU is reaped by whoever adopts orphans. On
    hosts whose PID 1 reaps slowly (seen here: about every 2 s), libvirt's destroy then
    waits for the zombie to vanish and every ``virsh destroy`` takes 2 s. Under a
    subreaper that waits for its children at once, QEMU is reaped immediately.
    """
    tini = shutil.which("tini")
    inner = f"exec {tini} -s -- libvirtd" if tini else "exec libvirtd -d"
    if hide_kvm:
        HIDDEN_KVM_FILE.parent.mkdir(parents=True, exist_ok=True)
        HIDDEN_KVM_FILE.touch()
        inner = f"mount --bind {HIDDEN_KVM_FILE} /dev/kvm && {inner}"
        cmd = ["unshare", "-m", "--propagation", "slave", "sh", "-c", inner]
    else:
        cmd = ["sh", "-c", inner]
    log.info("starting libvirtd: %s", " ".join(cmd))
    LIBVIRTD_LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LIBVIRTD_LOG, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
    if not tini:
        proc.wait(30)


def setup_host(*, restart: bool = False, kernel: Path | None = None) -> list[str]:
    """Configure libvirt and make sure virtlogd and libvirtd run; returns what was done."""
    if os.geteuid() != 0:
        raise NotRoot("host set-up")
    if not shutil.which("libvirtd"):
        raise HostError("libvirtd is not installed (apt-get install libvirt-daemon-system)")
    done: list[str] = []
    facts = detect(kernel)
    hide_kvm = facts.kvm.present and not facts.kvm.usable
    if configure_libvirt():
        done.append(f"configured {QEMU_CONF}")
        restart = True
    if cowhook.install_hook():
        done.append(f"installed {cowhook.HOOK_PATH}")
        restart = True
    Path(cowhook.MEMORY_BACKING_DIR).mkdir(parents=True, exist_ok=True)
    if not _procs("virtlogd"):
        subprocess.run(["virtlogd", "-d"], check=True)
        done.append("started virtlogd")
    running = _procs("libvirtd")
    if running and hide_kvm and not all(libvirtd_hides_kvm(p) for p in running):
        done.append("libvirtd saw the unusable /dev/kvm")
        restart = True
    if running and restart:
        for proc in running:
            proc.terminate()
        psutil.wait_procs(running, timeout=10)
        done.append("stopped libvirtd")
        running = []
    if not running:
        _start_libvirtd(hide_kvm)
        done.append("started libvirtd" + (" with /dev/kvm hidden (KVM unusable here)" if hide_kvm else ""))
    _wait_libvirt(config_mod.load().libvirt_uri, LIBVIRTD_START_TIMEOUT_S)
    return done
