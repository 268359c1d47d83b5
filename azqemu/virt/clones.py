"""Sandboxes: clones of a template, started from its device state with their own RAM.

A clone starts paused with ``-incoming defer``; its RAM is filled from the template (an eager
copy of the template's data extents, or left empty and served lazily through userfaultfd by
a ``RamFiller`` the manager supplies), then the device state is loaded over a unix migration
socket with ``x-ignore-shared`` (``exec:`` dies under libvirt's seccomp ``spawn=deny``), and
the clone is resumed. Records of sandboxes live in ``<state_dir>/sandboxes/<name>.json``;
libvirt (transient domains with our metadata) stays the truth about what runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from azqemu import config as config_mod
from azqemu.agent import GuestAgent
from azqemu.errors import AzqemuError, ConfigError, SandboxExists, SandboxNotFound, VirtError
from azqemu.host import procfs
from azqemu.names import validate_name
from azqemu.qmp import Monitor
from azqemu.sched.policy import DEFAULT_GRACE_S
from azqemu.virt import domxml, ramfile
from azqemu.virt.host import Domain, Host
from azqemu.virt.identity import (
    Identity,
    allocate_qemu_ids,
    new_identity,
    open_to_qemu_group,
    prepare_vm_dir,
    release_qemu_uid,
    remove_vm_dir,
)
from azqemu.virt.templates import TemplateMeta, TemplateRepo

log = logging.getLogger(__name__)

MIGRATION_TIMEOUT_S = 60.0
AGENT_TIMEOUT_S = 60.0
DEFAULT_SHARING_DOMAIN = "default"


@dataclass
class SandboxRecord:
    name: str
    template: str
    sharing_domain: str
    ram_mode: str             # "eager" | "lazy" | "cow"
    uuid: str
    created_at: float
    clone_s: float = 0.0      # request -> guest agent answering
    policy: str = "manual"    # azqemu.sched.policy
    grace_s: float = DEFAULT_GRACE_S      # LLM wait before the policy acts
    state: str = "running"    # lifecycle state (azqemu/daemon/states.py), kept by the daemon
    failed_reason: str | None = None   # why it is ``failed``
    qemu_uid: int | None = None   # the uid its QEMU runs as (identity.allocate_qemu_ids)
    # Paused by its user (azq pause): a restarted manager leaves it paused, and continues a
    # sandbox that its predecessor paused for a trim. None: a record from before this was kept.
    user_paused: bool | None = None
    # The orchestrator's labels and the unix time its time to live ends (daemon/tags.py).
    labels: dict[str, str] = field(default_factory=dict)
    expires_at: float | None = None


# Called with (domain, qemu pid, identity, template) while the clone is paused, before its
# device state is loaded: puts the template's RAM in place (eagerly or lazily).
RamFiller = Callable[[Domain, int, Identity, TemplateMeta], None]


class SandboxRepo:
    def __init__(self, cfg: config_mod.Config | None = None) -> None:
        self.cfg = cfg or config_mod.load()
        self.root = self.cfg.sandboxes_dir

    def path(self, name: str) -> Path:
        return self.root / f"{name}.json"

    def save(self, rec: SandboxRecord) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.path(rec.name).with_suffix(".json.tmp")
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, self.path(rec.name))

    def get(self, name: str) -> SandboxRecord:
        try:
            raw = json.loads(self.path(name).read_text())
        except (FileNotFoundError, ValueError):
            raise SandboxNotFound(name) from None
        return SandboxRecord(**{k: v for k, v in raw.items() if k in SandboxRecord.__dataclass_fields__})

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(name).unlink()

    def list(self) -> list[SandboxRecord]:
        if not self.root.exists():
            return []
        out = []
        for p in sorted(self.root.glob("*.json")):
            with contextlib.suppress(SandboxNotFound):
                out.append(self.get(p.stem))
        return out


def cow_fill(_dom: Domain, _pid: int, _ident: Identity, _tmpl: TemplateMeta) -> None:
    """Copy-on-write clones map the template image itself (azqemu/virt/cowhook.py): no copy."""


def eager_fill(_dom: Domain, pid: int, _ident: Identity, tmpl: TemplateMeta) -> None:
    """Copy the template's data extents into the clone's RAM memfd."""
    repo = TemplateRepo()
    ramfile.copy_into(repo.ram_path(tmpl.name), procfs.find_ram_fd(pid))


def _send_devstate(devstate: Path, sock_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(sock_path))
            break
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise VirtError(f"clone did not open its migration socket {sock_path}") from None
            time.sleep(0.005)
    with s, open(devstate, "rb") as f:
        s.sendfile(f)


def clone_one(host: Host, tmpl: TemplateMeta, name: str, *, sharing_domain: str, ram_mode: str,
              fill: RamFiller, repo: SandboxRepo, env: dict[str, str] | None = None,
              ram_backing: str = "memfd", wait_agent: bool = True, policy: str = "manual",
              grace_s: float = DEFAULT_GRACE_S, ksm_merge: bool = False) -> SandboxRecord:
    """Start one clone of ``tmpl``; on any failure nothing of it is left behind."""
    validate_name(name, "sandbox name")
    validate_name(sharing_domain, "sharing domain")
    if host.has_domain(name) or repo.path(name).exists():
        raise SandboxExists(name)
    t0 = time.monotonic()
    # Its own QEMU uid, one no other sandbox's record names (DAC isolation between QEMUs).
    qemu_ids = allocate_qemu_ids(r.qemu_uid for r in repo.list() if r.qemu_uid is not None)
    ident = new_identity(name, qemu=qemu_ids)
    if env and "AZQ_UFFD_SOCKET" in env:
        env = {**env, "AZQ_UFFD_SOCKET": str(ident.uffd_socket)}
    trepo = TemplateRepo()
    dom: Domain | None = None
    try:
        prepare_vm_dir(ident)
        if ram_backing == "file-private" and qemu_ids is not None:
            open_to_qemu_group(trepo.ram_path(tmpl.name))   # mapped by QEMUs of many uids
        spec = domxml.DomainSpec(
            ident=ident, mem_mib=tmpl.mem_mib, vcpus=tmpl.vcpus, kernel=Path(tmpl.kernel),
            initrd=Path(tmpl.initrd), rootfs=Path(tmpl.rootfs), cmdline=tmpl.cmdline,
            libvirt_type=tmpl.libvirt_type, machine=tmpl.machine, incoming=True, env=env or {},
            ram_backing=ram_backing, ksm_merge=ksm_merge,
            tcg_tb_cache_mib=config_mod.tcg_tb_cache_mib(),
            metadata={"role": "sandbox", "template": tmpl.name, "sharing-domain": sharing_domain,
                      # Several managers (state directories) may share one libvirtd.
                      "state-dir": str(repo.cfg.state_dir),
                      "ram-mode": ram_mode,
                      **({"cow-ram": str(trepo.ram_path(tmpl.name))} if ram_backing == "file-private" else {})})
        dom = host.create_transient(domxml.build(spec), name, paused=True)
        pid = dom.qemu_pid()
        if pid is None:
            raise VirtError(f"cannot find QEMU of {name}")
        fill(dom, pid, ident, tmpl)
        with Monitor(ident.qmp_socket) as mon:
            mon.set_migration_capabilities(x_ignore_shared=True)
            mon.execute("migrate-incoming", uri=f"unix:{ident.migration_socket}")
            _send_devstate(trepo.devstate_path(tmpl.name), ident.migration_socket, MIGRATION_TIMEOUT_S)
            mon.wait_migration(MIGRATION_TIMEOUT_S, poll_s=0.002)
        dom.resume()
        if wait_agent:
            GuestAgent(name, dom.agent_command).wait_ready(AGENT_TIMEOUT_S)
        rec = SandboxRecord(name=name, template=tmpl.name, sharing_domain=sharing_domain,
                            ram_mode=ram_mode, uuid=ident.uuid, created_at=time.time(),
                            clone_s=time.monotonic() - t0, policy=policy, grace_s=grace_s,
                            qemu_uid=qemu_ids.uid if qemu_ids is not None else None, user_paused=False)
        repo.save(rec)
        return rec
    except BaseException:
        if dom is not None:
            with contextlib.suppress(AzqemuError):
                dom.destroy()
        remove_vm_dir(name)
        repo.remove(name)
        raise
    finally:
        if qemu_ids is not None:
            release_qemu_uid(qemu_ids.uid)     # in the saved record now, or free again


def destroy(host: Host, repo: SandboxRepo, name: str) -> None:
    """Stop the domain, remove its sockets and record. Unknown names raise SandboxNotFound."""
    known = repo.path(name).exists()
    try:
        dom = host.get_domain(name)
    except AzqemuError:
        dom = None
    if dom is None and not known:
        raise SandboxNotFound(name)
    if dom is not None:
        if not dom.metadata().get("role") == "sandbox":
            raise ConfigError(f"{name!r} is not an azqemu sandbox")
        with contextlib.suppress(VirtError):
            dom.destroy()
    remove_vm_dir(name)
    repo.remove(name)
