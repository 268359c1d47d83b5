"""What every clone must change, in one place.

A clone starts from the template's device state, so everything that identifies a machine is
copied unless it is changed on purpose (virt-manager's cloner keeps the same list):
"""

from __future__ import annotations

import grp
import os
import pwd
import random
import shutil
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from azqemu import config as config_mod
from azqemu.errors import HostError

# QEMU's own OUI for locally made NICs; the low three bytes are random per clone.
MAC_PREFIX = "52:54:00"
QEMU_USER = "libvirt-qemu"
QEMU_GROUP = "libvirt-qemu"
# Each sandbox's QEMU runs as a uid of its own (libvirt's static DAC <seclabel>), so a QEMU
# that a guest escaped into cannot open another sandbox's sockets (QMP, export, agents) or
# /proc/PID/mem. The range is reserved for azqemu: far above login users (< 60000), Debian's
# dynamic system ids and the usual subordinate-id ranges (100000 + 65536 per user); no
# passwd entry names these ids. The group is shared (QEMU_GROUP): the template images that
# copy-on-write clones map must be open to every clone.
QEMU_UID_FIRST = 1_900_000_000
QEMU_UID_COUNT = 1 << 20


class _SocketDir:
    """The sockets of one domain's directory (``vm_dir``): the one place that names them."""

    vm_dir: Path

    @property
    def qmp_socket(self) -> Path:
        return self.vm_dir / "qmp.sock"

    @property
    def migration_socket(self) -> Path:
        return self.vm_dir / "migrate.sock"

    @property
    def uffd_socket(self) -> Path:
        return self.vm_dir / "uffd.sock"

    @property
    def guest_agent_socket(self) -> Path:
        return self.vm_dir / "qemu-ga.sock"

    @property
    def azq_agent_socket(self) -> Path:
        return self.vm_dir / "azq-agent.sock"


@dataclass(frozen=True)
class QemuIds:
    """The uid and gid one domain's QEMU runs as (libvirt ``<seclabel model='dac'>``)."""

    uid: int
    gid: int

    @property
    def label(self) -> str:
        return f"+{self.uid}:+{self.gid}"   # "+": numeric, no passwd lookup


@dataclass(frozen=True)
class Identity(_SocketDir):
    """Everything that makes one domain distinct from its siblings."""

    name: str
    uuid: str
    genid: str            # VM generation id: tells the guest it was cloned (reseed RNGs)
    mac: str
    vm_dir: Path          # per-domain sockets: QMP, migration, uffd export, agent channels
    qemu: QemuIds | None = None   # its own QEMU user (None: libvirt's default user)


@dataclass(frozen=True)
class VmPaths(_SocketDir):
    """The paths of a domain that exists: the ones its identity gave it when it was made."""

    vm_dir: Path


def vm_paths(name: str, cfg: config_mod.Config | None = None) -> VmPaths:
    """Where the sockets of domain ``name`` are (``<run_dir>/vm/<name>/``)."""
    return VmPaths((cfg or config_mod.load()).run_dir / "vm" / name)


def new_identity(name: str, rng: random.Random | None = None, qemu: QemuIds | None = None) -> Identity:
    """The clone checklist. Each clone gets:

    - a new name (libvirt refuses a duplicate; the caller checks first for a clear error);
    - a new UUID (libvirt and the guest's DMI serial);
    - a new VM generation id (``<genid>``), so the guest kernel knows it is a copy;
    - a new MAC address for its NIC;
    - its own directory of sockets: QMP monitor, migration, userfaultfd export, guest-agent
      and azqemu-agent channels (two clones must never share a socket path);
    - its own QEMU uid (``qemu``, from ``allocate_qemu_ids``), owner of that directory alone.
    """
    rng = rng or random.SystemRandom()
    mac = MAC_PREFIX + "".join(f":{rng.randrange(256):02x}" for _ in range(3))
    return Identity(name=name, uuid=str(uuid.uuid4()), genid=str(uuid.uuid4()), mac=mac,
                    vm_dir=vm_paths(name).vm_dir, qemu=qemu)


def prepare_vm_dir(ident: Identity) -> None:
    """Create the socket directory, writable by the user QEMU runs as under libvirt: the
    domain's own uid (mode 0700: no other QEMU can enter), or libvirt's QEMU user."""
    ident.vm_dir.mkdir(parents=True, exist_ok=True)
    if ident.qemu is not None:
        os.chown(ident.vm_dir, ident.qemu.uid, ident.qemu.gid)
        os.chmod(ident.vm_dir, 0o700)
    else:
        try:
            pw = pwd.getpwnam(QEMU_USER)
            os.chown(ident.vm_dir, pw.pw_uid, pw.pw_gid)
        except KeyError:
            pass  # QEMU runs as root (qemu.conf user = "root"): nothing to hand over
        os.chmod(ident.vm_dir, 0o750)
    os.chmod(ident.vm_dir.parent, 0o755)


# -- per-domain QEMU users ------------------------------------------------------------------
_ids_lock = threading.Lock()
_reserved: set[int] = set()   # allocated here, not yet in a saved record


def qemu_group_gid() -> int | None:
    """The shared group of sandbox QEMUs (None where it does not exist: QEMU runs as root)."""
    try:
        return grp.getgrnam(QEMU_GROUP).gr_gid
    except KeyError:
        return None


def _live_qemu_uids() -> set[int]:
    """uids of the range that running processes use (another manager's sandboxes too)."""
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                uid = entry.stat(follow_symlinks=False).st_uid
            except OSError:
                continue
            if QEMU_UID_FIRST <= uid < QEMU_UID_FIRST + QEMU_UID_COUNT:
                out.add(uid)
    return out


def allocate_qemu_ids(taken: Iterable[int], rng: random.Random | None = None) -> QemuIds | None:
    """A uid of the reserved range that no record (``taken``), no allocation in flight and no
    live process uses; None where sandbox QEMUs have no group to share (no isolation to
    give) or ``AZQ_QEMU_OWN_UIDS=0`` turns it off (every QEMU then runs as libvirt's QEMU
    user, as before). The caller saves it in the sandbox's record, then calls
    ``release_qemu_uid``.

    Known race, accepted: two managers (two state directories on one host) allocating at the
    same instant could pick one uid; the start offset is random over 2^20 ids, and each
    scans the live processes first."""
    gid = qemu_group_gid()
    if gid is None or os.environ.get("AZQ_QEMU_OWN_UIDS", "1") == "0":
        return None
    start = (rng or random.SystemRandom()).randrange(QEMU_UID_COUNT)
    with _ids_lock:
        busy = set(taken) | _reserved | _live_qemu_uids()
        for i in range(QEMU_UID_COUNT):
            uid = QEMU_UID_FIRST + (start + i) % QEMU_UID_COUNT
            if uid not in busy:
                _reserved.add(uid)
                return QemuIds(uid, gid)
    raise HostError(f"no free QEMU uid left in [{QEMU_UID_FIRST}, +{QEMU_UID_COUNT})")


def release_qemu_uid(uid: int) -> None:
    """The allocation is in a saved record now (or the clone failed): no longer in flight."""
    with _ids_lock:
        _reserved.discard(uid)


def open_to_qemu_group(path: Path) -> None:
    """Let every sandbox QEMU (the shared group) open ``path`` read-write: QEMU 7.2 opens a
    memory-backend-file read-write even with share=off (its mapping stays private)."""
    gid = qemu_group_gid()
    if gid is None:
        return
    st = path.stat()
    if st.st_gid != gid:
        os.chown(path, -1, gid)
    if st.st_mode & 0o060 != 0o060:
        os.chmod(path, (st.st_mode & 0o7777) | 0o060)


def remove_vm_dir(name: str) -> None:
    shutil.rmtree(vm_paths(name).vm_dir, ignore_errors=True)
