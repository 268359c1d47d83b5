"""What every clone must change, in one place.

A clone starts from the template's device state, so everything that identifies a machine is
copied unless it is changed on purpose (virt-manager's cloner keeps the same list):
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from azqemu import config as config_mod

# QEMU's own OUI for locally made NICs; the low three bytes are random per clone.
MAC_PREFIX = "52:54:00"
QEMU_USER = "libvirt-qemu"


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
class Identity(_SocketDir):
    """Everything that makes one domain distinct from its siblings."""

    name: str
    uuid: str
    genid: str            # VM generation id: tells the guest it was cloned (reseed RNGs)
    mac: str
    vm_dir: Path          # per-domain sockets: QMP, migration, uffd export, agent channels


@dataclass(frozen=True)
class VmPaths(_SocketDir):
    """The paths of a domain that exists: the ones its identity gave it when it was made."""

    vm_dir: Path


def vm_paths(name: str, cfg: config_mod.Config | None = None) -> VmPaths:
    """Where the sockets of domain ``name`` are (``<run_dir>/vm/<name>/``)."""
    return VmPaths((cfg or config_mod.load()).run_dir / "vm" / name)


def new_identity(name: str, rng: random.Random | None = None) -> Identity:
    """The clone checklist. Each clone gets:

    - a new name (libvirt refuses a duplicate; the caller checks first for a clear error);
    - a new UUID (libvirt and the guest's DMI serial);
    - a new VM generation id (``<genid>``), so the guest kernel knows it is a copy;
    - a new MAC address for its NIC;
    - its own directory of sockets: QMP monitor, migration, userfaultfd export, guest-agent
      and azqemu-agent channels (two clones must never share a socket path).
    """
    rng = rng or random.SystemRandom()
    mac = MAC_PREFIX + "".join(f":{rng.randrange(256):02x}" for _ in range(3))
    return Identity(name=name, uuid=str(uuid.uuid4()), genid=str(uuid.uuid4()), mac=mac,
                    vm_dir=vm_paths(name).vm_dir)


def prepare_vm_dir(ident: Identity) -> None:
    """Create the socket directory, writable by the user QEMU runs as under libvirt."""
    ident.vm_dir.mkdir(parents=True, exist_ok=True)
    try:
        pw = pwd.getpwnam(QEMU_USER)
        os.chown(ident.vm_dir, pw.pw_uid, pw.pw_gid)
    except KeyError:
        pass  # QEMU runs as root (qemu.conf user = "root"): nothing to hand over
    os.chmod(ident.vm_dir, 0o750)
    os.chmod(ident.vm_dir.parent, 0o755)


def remove_vm_dir(name: str) -> None:
    shutil.rmtree(vm_paths(name).vm_dir, ignore_errors=True)
