"""Templates: a booted, warmed-up guest saved as device state plus an immutable RAM image.

On disk, under ``<state_dir>/templates/<name>/``:
    meta.json      what the template is (image key, memory, vCPUs, machine type, accelerator)
    devstate.bin   device state saved with ``x-ignore-shared`` (RAM left out: a few hundred KB)
    ram.img        the guest RAM image, sparse (zero pages are holes): the persistent copy
and its working copy on tmpfs, ``<shm_dir>/templates/<name>/ram.img``, which clones share
read-only (copy-on-write clones map it privately). It has to be tmpfs: a clone azqemu
compresses is served through userfaultfd in MINOR mode, which only shmem (and hugetlbfs)
supports, and its untouched pages stay the template's page cache. The working copy is made
again from the disk copy when missing (after a reboot emptied /dev/shm).
A template is built in ``<name>.tmp-<pid>/`` and renamed into place only when complete, so an
interrupted ``template create`` leaves nothing a later command could mistake for a template.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import pwd
import shlex
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from azqemu import config as config_mod
from azqemu.agent import GuestAgent
from azqemu.errors import (
    ConfigError,
    DiskFull,
    ExecError,
    TemplateExists,
    TemplateInUse,
    TemplateNotFound,
)
from azqemu.host import procfs
from azqemu.host import setup as hostsetup
from azqemu.host.threads import os_named
from azqemu.image import GuestImage, find_image
from azqemu.names import validate_name
from azqemu.qmp import Monitor
from azqemu.virt import domxml, ramfile
from azqemu.virt.host import Domain, Host
from azqemu.virt.identity import QEMU_USER, new_identity, prepare_vm_dir, remove_vm_dir

log = logging.getLogger(__name__)
# One copy of a template image to tmpfs at a time (clones of a template start in parallel).
_RAM_COPY_LOCK = threading.Lock()

# Boot to a guest-agent answer takes ~7 s under TCG here; allow for a loaded host.
BOOT_TIMEOUT_S = 180.0
WARMUP_TIMEOUT_S = 600.0
MIGRATION_TIMEOUT_S = 120.0
TEMPLATE_DOMAIN_PREFIX = "azq-template-"
# Besides the RAM image (at most its size), a template needs its device state and slack.
DISK_SLACK_BYTES = 64 << 20


@dataclass
class TemplateMeta:
    name: str
    image_key: str
    kernel: str
    initrd: str
    rootfs: str
    cmdline: str
    mem_mib: int
    vcpus: int
    machine: str
    accel: str
    libvirt_type: str
    warmup: list[str] = field(default_factory=list)
    devstate_bytes: int = 0
    ram_data_bytes: int = 0
    boot_s: float = 0.0
    create_s: float = 0.0
    created_at: float = 0.0
    format_version: int = 1


class TemplateRepo:
    def __init__(self, cfg: config_mod.Config | None = None) -> None:
        self.cfg = cfg or config_mod.load()
        self.root = self.cfg.templates_dir

    def dir(self, name: str) -> Path:
        return self.root / name

    def disk_ram_path(self, name: str) -> Path:
        return self.dir(name) / "ram.img"

    def shm_dir(self, name: str) -> Path:
        return self.cfg.shm_dir / "templates" / name

    def _working_copy(self, name: str) -> Path:
        """Where the template's tmpfs working copy is (whether or not it exists yet)."""
        return self.shm_dir(name) / "ram.img"

    def ram_path(self, name: str) -> Path:
        """The template's RAM image that clones use (tmpfs), made from the disk copy if missing."""
        path = self._working_copy(name)
        if path.exists():
            return path
        disk = self.disk_ram_path(name)
        if not disk.exists():
            raise TemplateNotFound(name)
        with _RAM_COPY_LOCK:
            if not path.exists():
                self._copy_to_shm(name, disk, path)
        return path

    def give_back_zero_pages(self, name: str) -> int:
        """Punch the zero pages copy-on-write clones made the template's working copy hold
        back to holes (ramfile.punch_zero_pages); 0 if it has no working copy. Bytes given back."""
        path = self._working_copy(name)
        with _RAM_COPY_LOCK:
            if not path.exists():
                return 0
            return ramfile.punch_zero_pages(path)

    def _copy_to_shm(self, name: str, disk: Path, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        for d in (self.cfg.shm_dir, path.parent.parent, path.parent):
            os.chmod(d, 0o755)  # QEMU (libvirt-qemu) opens the image through these
        tmp = path.with_name(f"ram.img.tmp-{os.getpid()}")
        try:
            ramfile.save_sparse(disk, tmp, disk.stat().st_size)
            _share_with_qemu_file(tmp)
            os.rename(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        log.info("template %s: RAM image copied to %s", name, path)

    def devstate_path(self, name: str) -> Path:
        return self.dir(name) / "devstate.bin"

    def exists(self, name: str) -> bool:
        return (self.dir(name) / "meta.json").exists()

    def get(self, name: str) -> TemplateMeta:
        path = self.dir(name) / "meta.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise TemplateNotFound(name) from None
        except ValueError as exc:
            raise TemplateNotFound(name) from exc
        return TemplateMeta(**{k: v for k, v in raw.items() if k in TemplateMeta.__dataclass_fields__})

    def list(self) -> builtins.list[TemplateMeta]:
        if not self.root.exists():
            return []
        return [self.get(p.name) for p in sorted(self.root.iterdir())
                if (p / "meta.json").exists() and ".tmp-" not in p.name]

    def delete(self, name: str, clones: builtins.list[str]) -> None:
        if not self.exists(name):
            raise TemplateNotFound(name)
        if clones:
            raise TemplateInUse(name, clones)
        shutil.rmtree(self.shm_dir(name), ignore_errors=True)
        shutil.rmtree(self.dir(name))

    def remove_stale_builds(self) -> None:
        """Remove half-built templates left by a crashed manager."""
        if self.root.exists():
            for p in self.root.iterdir():
                if ".tmp-" in p.name:
                    shutil.rmtree(p, ignore_errors=True)


def _check_disk(path: Path, needed_bytes: int) -> None:
    probe = path
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < needed_bytes:
        raise DiskFull(str(path), needed_bytes, free)


class _StateReceiver:
    """Accepts QEMU's outgoing migration on 127.0.0.1 and writes the stream to a file."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.bytes = 0
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=os_named(self._run), name="azq-devstate-rx", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.sock.settimeout(MIGRATION_TIMEOUT_S)
            conn, _ = self.sock.accept()
            with conn, open(self.dest, "wb") as out:
                while chunk := conn.recv(1 << 20):
                    out.write(chunk)
                    self.bytes += len(chunk)
                out.flush()
                os.fsync(out.fileno())
        except BaseException as exc:  # noqa: BLE001 - reported by join()
            self.error = exc

    def join(self) -> int:
        self._thread.join(MIGRATION_TIMEOUT_S)
        self.sock.close()
        if self.error:
            raise ExecError(f"receiving device state failed: {self.error}")
        return self.bytes


def create_template(host: Host, repo: TemplateRepo, name: str, *, mem_mib: int = 512, vcpus: int = 1,
                    warmup: list[str] | None = None, image: GuestImage | None = None,
                    progress: Callable[[str], None] = lambda _m: None) -> TemplateMeta:
    """Boot the guest image, run the warm-up commands, save device state and RAM image."""
    validate_name(name, "template name")
    if mem_mib < 128 or mem_mib > 2048:
        raise ConfigError(f"template memory {mem_mib} MiB out of range (128-2048 MiB)")
    if vcpus < 1 or vcpus > 16:
        raise ConfigError(f"vCPUs {vcpus} out of range (1-16)")
    if repo.exists(name):
        raise TemplateExists(name)
    image = image or find_image()
    _check_disk(repo.root, (mem_mib << 20) + DISK_SLACK_BYTES)
    facts = hostsetup.detect(image.kernel)
    ident = new_identity(TEMPLATE_DOMAIN_PREFIX + name)
    work = repo.root / f"{name}.tmp-{os.getpid()}-{threading.get_ident()}"
    t0 = time.monotonic()
    dom: Domain | None = None
    try:
        work.mkdir(parents=True)
        prepare_vm_dir(ident)
        spec = domxml.DomainSpec(
            ident=ident, mem_mib=mem_mib, vcpus=vcpus, kernel=image.kernel, initrd=image.initrd,
            rootfs=image.rootfs, cmdline=image.cmdline, libvirt_type=facts.libvirt_type,
            tcg_tb_cache_mib=config_mod.tcg_tb_cache_mib(),
            metadata={"role": "template-build", "template": name, "state-dir": str(repo.cfg.state_dir)})
        progress(f"booting {ident.name} ({mem_mib} MiB, {vcpus} vCPU, {facts.accel})")
        dom = host.create_transient(domxml.build(spec), ident.name, paused=False)
        agent = GuestAgent(ident.name, dom.agent_command)
        boot_s = agent.wait_ready(BOOT_TIMEOUT_S)
        progress(f"guest agent answered after {boot_s:.1f} s")
        for cmd in warmup or []:
            progress(f"warm-up: {cmd}")
            res = agent.exec(["/bin/sh", "-c", cmd], timeout_s=WARMUP_TIMEOUT_S)
            if res.exit_code != 0:
                raise ExecError(f"warm-up command {cmd!r} exited {res.exit_code}: "
                                f"{res.stderr.decode(errors='replace').strip()[-200:]}")
        # Let the guest settle (page cache writeback, agent bookkeeping) before the snapshot.
        agent.exec(["/bin/sync"], timeout_s=60)
        dom.suspend()
        pid = dom.qemu_pid()
        if pid is None:
            raise ExecError(f"cannot find QEMU of {ident.name}")
        devstate = work / "devstate.bin"
        rx = _StateReceiver(devstate)
        with Monitor(ident.qmp_socket) as mon:
            mon.set_migration_capabilities(x_ignore_shared=True)
            mon.execute("migrate", uri=f"tcp:127.0.0.1:{rx.port}")
            mon.wait_migration(MIGRATION_TIMEOUT_S)
        devstate_bytes = rx.join()
        progress(f"device state saved ({devstate_bytes / 1024:.0f} KiB)")
        ram_bytes = ramfile.save_sparse(procfs.find_ram_fd(pid), work / "ram.img", mem_mib << 20)
        progress(f"RAM image saved ({ram_bytes >> 20} MiB of data in {mem_mib} MiB)")
        meta = TemplateMeta(
            name=name, image_key=image.key, kernel=str(image.kernel), initrd=str(image.initrd),
            rootfs=str(image.rootfs), cmdline=image.cmdline, mem_mib=mem_mib, vcpus=vcpus,
            machine=spec.machine, accel=facts.accel, libvirt_type=facts.libvirt_type,
            warmup=list(warmup or []), devstate_bytes=devstate_bytes, ram_data_bytes=ram_bytes,
            boot_s=boot_s, create_s=time.monotonic() - t0, created_at=time.time())
        (work / "meta.json").write_text(json.dumps(asdict(meta), indent=2))
        _share_with_qemu(work)
        if repo.exists(name):
            raise TemplateExists(name)
        os.rename(work, repo.dir(name))
        # The working copy now, not at the first clone: that clone would pay the copy (and a
        # density run's first policy would count the template's tmpfs pages as its own).
        try:
            repo.ram_path(name)
        except OSError as exc:
            log.warning("template %s: no working copy on tmpfs yet (%s): the first clone makes it", name, exc)
        return meta
    finally:
        if dom is not None:
            with contextlib.suppress(Exception):
                dom.destroy()
        remove_vm_dir(ident.name)
        shutil.rmtree(work, ignore_errors=True)


def _share_with_qemu(path: Path) -> None:
    """Copy-on-write clones map ram.img from QEMU (user libvirt-qemu): let that user read it.

    QEMU 7.2 opens a memory-backend-file read-write even with share=off, so the image belongs
    to the QEMU user; the template is still never written (the mapping is private).
    """
    os.chmod(path, 0o755)
    for f in path.iterdir():
        _share_with_qemu_file(f)


def _share_with_qemu_file(path: Path) -> None:
    try:
        pw = pwd.getpwnam(QEMU_USER)
    except KeyError:
        return
    os.chown(path, pw.pw_uid, pw.pw_gid)
    os.chmod(path, 0o640)


def warmup_from_cli(values: tuple[str, ...]) -> list[str]:
    """Each --warmup is one shell command line."""
    out = []
    for v in values:
        if not v.strip():
            raise ConfigError("empty --warmup command")
        shlex.split(v)  # reject unbalanced quotes early with a clear error
        out.append(v)
    return out
