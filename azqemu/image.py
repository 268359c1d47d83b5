"""Guest image: build, cache and find the kernel, initramfs and read-only rootfs VMs boot.

The recipe lives in images/ (recipe.toml, the initramfs /init, a rootfs overlay, the agent
workspace) and the in-guest agent in guest-agent/. An image is built from Debian's kernel
package, a busybox initramfs that loads virtio and ext4, and a debootstrap minbase root
packed with ``mkfs.ext4 -d`` (no loop mount). Built images live outside the repo in
``Config.image_cache_dir`` under a key hashed from the recipe's content, so a second build
is a no-op and an edited recipe rebuilds. Every build happens in a temporary directory in
the cache and is renamed into place, so an interrupted build leaves nothing half-made.

Cache layout::

    <cache>/<key>/vmlinuz  initrd.img  rootfs.ext4  manifest.json
    <cache>/current -> <key>          the last image built (for humans; code looks up by key)
    <cache>/.lock                     serialises builds
    <cache>/.build-<key>-XXXX/        a build in progress (removed on success or failure)
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import json
import logging
import lzma
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from azqemu import config as azq_config
from azqemu.errors import ImageError

log = logging.getLogger(__name__)

# Bump when this module changes what it produces: it is part of every cache key.
BUILDER_VERSION = 1
MANIFEST_MAGIC = "azqemu-guest-image"
MANIFEST_VERSION = 1
NOT_BUILT = "guest image not built: run 'azq image build'"

RECIPE_DIR = Path(os.environ.get("AZQ_IMAGE_RECIPE_DIR", azq_config.REPO_ROOT / "images"))
GUEST_AGENT_DIR = Path(os.environ.get("AZQ_GUEST_AGENT_DIR", azq_config.REPO_ROOT / "guest-agent"))
KERNEL_ENV = "AZQ_IMAGE_KERNEL"          # overrides recipe.toml's kernel ABI (part of the key)

BZIMAGE_NAME, PVH_NAME = "vmlinuz", "vmlinux"    # the kernel as shipped / uncompressed ELF
INITRD_NAME, ROOTFS_NAME, MANIFEST_NAME = "initrd.img", "rootfs.ext4", "manifest.json"
KERNEL_BOOTS = ("pvh", "bzimage")
GUEST_AGENT_TARGET = "usr/local/lib/azq-agent"   # where guest-agent/ goes in the rootfs
WORKSPACE_TARGET = "opt/azq-workspace"           # copied to a tmpfs /workspace at boot
# Files that are never part of the recipe (build droppings of tests run on the host).
IGNORED_NAMES = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".git"}
IGNORED_SUFFIXES = (".pyc", ".pyo", "~", ".swp")
# Room a build needs in the cache: the unpacked rootfs tree, its image, the kernel tree.
BUILD_SPACE_BYTES = 2 << 30
STDERR_TAIL_LINES = 20

Progress = Callable[[str], None]


@dataclass(frozen=True)
class GuestImage:
    """A built image: what a VM boots (direct kernel boot, rootfs as a read-only virtio disk).

    ``size_bytes`` is the sum of the three files' sizes (the rootfs is sparse: its apparent
    size). Every file is mode 0644 so the libvirt-qemu user can read it.
    """

    kernel: Path
    initrd: Path
    rootfs: Path
    cmdline: str
    key: str
    size_bytes: int

    def to_dict(self) -> dict[str, str | int]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Recipe:
    """images/recipe.toml, read and checked."""

    kernel_abi: str
    kernel_boot: str
    modules: tuple[str, ...]
    cmdline: str
    busybox_package: str
    suite: str
    mirror: str
    variant: str
    include: tuple[str, ...]
    prune: tuple[str, ...]
    readonly: tuple[str, ...]
    slack_mib: int

    @property
    def kernel_package(self) -> str:
        return f"linux-image-{self.kernel_abi}"


def load_recipe(recipe_dir: Path | None = None) -> Recipe:
    """Read recipe.toml; AZQ_IMAGE_KERNEL overrides the kernel ABI."""
    path = (recipe_dir or RECIPE_DIR) / "recipe.toml"
    try:
        data = tomllib.loads(path.read_text())
        kernel, initramfs, rootfs = data["kernel"], data["initramfs"], data["rootfs"]
        recipe = Recipe(
            kernel_abi=os.environ.get(KERNEL_ENV) or kernel["abi"],
            kernel_boot=kernel.get("boot", "bzimage"),
            modules=tuple(kernel["modules"]),
            cmdline=" ".join(kernel["cmdline"].split()),
            busybox_package=initramfs["busybox_package"],
            suite=rootfs["suite"], mirror=rootfs["mirror"], variant=rootfs["variant"],
            include=tuple(rootfs["include"]), prune=tuple(rootfs["prune"]),
            readonly=tuple(rootfs.get("readonly", ())),
            slack_mib=int(rootfs["slack_mib"]),
        )
    except FileNotFoundError as err:
        raise ImageError(f"image recipe not found: {path} (set AZQ_IMAGE_RECIPE_DIR)") from err
    except (KeyError, TypeError, ValueError, tomllib.TOMLDecodeError) as err:
        raise ImageError(f"bad image recipe {path}: {type(err).__name__}: {err}") from err
    if recipe.kernel_boot not in KERNEL_BOOTS:
        raise ImageError(f"bad image recipe {path}: [kernel] boot must be one of {', '.join(KERNEL_BOOTS)}")
    for needed in ("console=ttyS0", "root=/dev/vda", " ro"):
        if needed not in f" {recipe.cmdline}":
            raise ImageError(f"bad image recipe {path}: kernel cmdline lacks {needed.strip()!r}")
    return recipe


# ---------------------------------------------------------------- cache key and lookup

def _recipe_files(root: Path) -> Iterator[Path]:
    """Every file under root that belongs to the recipe, sorted, build droppings left out."""
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_NAMES)
        for name in sorted(filenames):
            if name not in IGNORED_NAMES and not name.endswith(IGNORED_SUFFIXES):
                yield Path(dirpath) / name


def recipe_key(recipe_dir: Path | None = None, agent_dir: Path | None = None,
               kernel_abi: str | None = None) -> str:
    """The cache key: a hash of every recipe and guest-agent file, the kernel, the builder.

    Paths, contents, the executable bit and symlink targets count; mtimes do not, so a
    fresh checkout of the same recipe finds the same image.
    """
    recipe_dir = recipe_dir or RECIPE_DIR
    agent_dir = agent_dir or GUEST_AGENT_DIR
    if kernel_abi is None:
        kernel_abi = load_recipe(recipe_dir).kernel_abi
    digest = hashlib.sha256()
    digest.update(f"{MANIFEST_MAGIC}\0builder={BUILDER_VERSION}\0kernel={kernel_abi}\0".encode())
    for label, root in (("images", recipe_dir), ("guest-agent", agent_dir)):
        for path in _recipe_files(root):
            rel = f"{label}/{path.relative_to(root).as_posix()}"
            if path.is_symlink():
                body, kind = os.readlink(path).encode(), "l"
            else:
                body, kind = path.read_bytes(), "x" if path.stat().st_mode & 0o111 else "f"
            digest.update(f"{rel}\0{kind}\0{len(body)}\0".encode())
            digest.update(body)
    return digest.hexdigest()[:16]


def _cache_dir(cfg: azq_config.Config | None) -> Path:
    return (cfg or azq_config.load()).image_cache_dir


def image_by_key(key: str, cfg: azq_config.Config | None = None, verify: bool = False) -> GuestImage:
    """The image built under ``key`` (a template records the key it was made from).

    Checks the manifest's magic, version and file sizes; with ``verify`` also the sha256 of
    every file (a second or two for the rootfs).
    """
    image_dir = _cache_dir(cfg) / key
    manifest_path = image_dir / MANIFEST_NAME
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError as err:
        raise ImageError(NOT_BUILT) from err
    except (OSError, ValueError) as err:
        raise ImageError(f"unreadable image manifest {manifest_path}: {err}") from err
    if manifest.get("magic") != MANIFEST_MAGIC or manifest.get("version") != MANIFEST_VERSION:
        raise ImageError(f"{manifest_path} is not a version-{MANIFEST_VERSION} azqemu image manifest: "
                         "rebuild with 'azq image build --force'")
    paths = {}
    for role, info in manifest["files"].items():
        path = image_dir / info["name"]
        try:
            size_bytes = path.stat().st_size
        except OSError as err:
            raise ImageError(f"guest image {key} is damaged: {path} is missing; "
                             "rebuild with 'azq image build --force'") from err
        if size_bytes != info["size_bytes"]:
            raise ImageError(f"guest image {key} is damaged: {path} has {size_bytes} bytes, "
                             f"manifest says {info['size_bytes']}")
        if verify and _sha256(path) != info["sha256"]:
            raise ImageError(f"guest image {key} is damaged: {path} does not match its sha256")
        paths[role] = path
    return GuestImage(kernel=paths["kernel"], initrd=paths["initrd"], rootfs=paths["rootfs"],
                      cmdline=manifest["cmdline"], key=key,
                      size_bytes=sum(info["size_bytes"] for info in manifest["files"].values()))


def find_image(cfg: azq_config.Config | None = None) -> GuestImage:
    """The image for the current recipe; ImageError(NOT_BUILT) when it has not been built."""
    return image_by_key(recipe_key(), cfg)


def read_manifest(image: GuestImage) -> dict:
    """The build record of an image (kernel version, package list size, build time)."""
    return json.loads((image.kernel.parent / MANIFEST_NAME).read_text())


def _keys_in_use(cfg: azq_config.Config) -> set[str]:
    """Image keys that templates were made from (their clones keep booting from those files)."""
    keys = set()
    for meta in cfg.templates_dir.glob("*/meta.json"):
        try:
            keys.add(str(json.loads(meta.read_text())["image_key"]))
        except (OSError, ValueError, KeyError) as err:
            log.warning("cannot read the image key of %s: %s", meta, err)
    return keys


def prune_images(cfg: azq_config.Config | None = None, dry_run: bool = False) -> list[Path]:
    """Remove cached images nothing needs; returns what was (or would be) removed.

    Kept: the image of the current recipe, the one `current` points to, and every image a
    template names (clones of a template boot its image's rootfs).
    """
    cfg = cfg or azq_config.load()
    cache_dir = cfg.image_cache_dir
    if not cache_dir.is_dir():
        return []
    keep = _keys_in_use(cfg) | {recipe_key()}
    if (cache_dir / "current").is_symlink():
        keep.add(os.readlink(cache_dir / "current"))
    doomed = sorted(p for p in cache_dir.iterdir()
                    if p.is_dir() and not p.is_symlink() and not p.name.startswith(".")
                    and (p / MANIFEST_NAME).exists() and p.name not in keep)
    if not dry_run:
        with _build_lock(cache_dir, lambda line: log.info("%s", line)):
            for path in doomed:
                _remove_tree(path)
    return doomed


# ---------------------------------------------------------------- running tools

TOOL_PACKAGES = {"debootstrap": "debootstrap", "mkfs.ext4": "e2fsprogs", "e2fsck": "e2fsprogs",
                 "depmod": "kmod", "apt-get": "apt", "dpkg-deb": "dpkg", "chroot": "coreutils"}


def _run(argv: list[str], what: str, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run a build tool; a failure becomes one ImageError line, its output's tail the log.

    The tool gets its own process group, and any exception here (Ctrl-C, the SIGTERM that
    build_image turns into one) kills the whole group: debootstrap's dpkg and chroot
    children must not go on writing into a build dir that is being deleted.
    """
    log.debug("run: %s", " ".join(argv))
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    except FileNotFoundError as err:
        package = TOOL_PACKAGES.get(Path(argv[0]).name, argv[0])
        raise ImageError(f"{what}: {argv[0]} not found (apt-get install {package})") from err
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = (stderr or stdout or "").strip().splitlines()[-STDERR_TAIL_LINES:]
        log.error("%s failed (exit %d): %s\n%s", what, proc.returncode, " ".join(argv), "\n".join(tail))
        last = tail[-1].strip() if tail else "no output"
        raise ImageError(f"{what} failed (exit {proc.returncode}): {last}")
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt while building, so the build dir is cleaned up
    (Python's default SIGTERM ends the process without running finally blocks)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _apt_download(package: str, dest: Path, say: Progress) -> Path:
    """``apt-get download`` one package into dest. On failure the package lists are
    refreshed once (a fresh machine has none; an old one may name removed versions) and
    the download retried; a kernel that is still missing names where to find another."""
    dest.mkdir(parents=True, exist_ok=True)
    # Sandbox user root: dest is a private build dir that _apt cannot enter.
    argv = ["apt-get", "download", "-q", "-o", "APT::Sandbox::User=root", package]
    try:
        _run(argv, f"apt-get download {package}", cwd=dest)
    except ImageError:
        say(f"apt-get download {package} failed: running apt-get update once")
        _run(["apt-get", "update", "-q"], "apt-get update")
        try:
            _run(argv, f"apt-get download {package}", cwd=dest)
        except ImageError as err:
            hint = ""
            if package.startswith("linux-image-"):
                hint = (f"; set [kernel] abi in recipe.toml (or {KERNEL_ENV}) to one listed by "
                        "apt-cache policy 'linux-image-6.1.0-*-amd64'")
            raise ImageError(f"{err}{hint}") from err
    debs = sorted(dest.glob(f"{package}_*.deb"))
    if not debs:
        raise ImageError(f"apt-get download {package} left no .deb in {dest}")
    return debs[-1]


def _deb_version(deb: Path) -> str:
    return _run(["dpkg-deb", "-f", str(deb), "Version"], f"dpkg-deb -f {deb.name}").stdout.strip()


def _unmount_under(path: Path) -> None:
    """Unmount anything a killed debootstrap left mounted below path (deepest first)."""
    prefix = str(path.resolve()) + "/"
    try:
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return
    for mount_point in sorted((m for m in mounts if m.startswith(prefix)), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount_point], check=False, capture_output=True)


def _kill_users_of(path: Path) -> None:
    """SIGKILL processes working inside path: after a builder was SIGKILLed, its debootstrap
    (own session) and the dpkg it chroot'ed into the tree may still run. Found by their
    root or cwd (/proc/PID/root, /proc/PID/cwd) or an argument naming the path."""
    prefix = str(path.resolve())
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            places = [os.readlink(proc_dir / "root"), os.readlink(proc_dir / "cwd"),
                      *(proc_dir / "cmdline").read_bytes().decode(errors="replace").split("\0")]
        except OSError:
            continue                        # gone meanwhile, or a kernel thread
        if any(p == prefix or p.startswith(prefix + "/") for p in places):
            with contextlib.suppress(OSError):
                os.kill(int(proc_dir.name), signal.SIGKILL)
                log.warning("killed pid %s left working in %s", proc_dir.name, path)


def _remove_tree(path: Path) -> None:
    """Delete a build dir without ever following a mount out of it."""
    if not path.exists():
        return
    _unmount_under(path)
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], check=False, capture_output=True)
    if path.exists():
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- the kernel

XEN_ELFNOTE_PHYS32_ENTRY = 18       # the PVH entry point note (include/xen/interface/elfnote.h)
PT_NOTE = 4


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed ELF kernel inside a bzImage (as scripts/extract-vmlinux finds it).

    Boot protocol (Documentation/x86/boot.rst): setup_sects at 0x1f1; the protected-mode
    code starts at (setup_sects + 1) * 512; payload_offset (0x248) and payload_length
    (0x24c) locate the compressed vmlinux within it.
    """
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        raise ImageError("the kernel is not a bzImage (no HdrS boot header)")
    setup_sects = bzimage[0x1F1] or 4
    payload_offset = int.from_bytes(bzimage[0x248:0x24C], "little")
    payload_length = int.from_bytes(bzimage[0x24C:0x250], "little")
    start = (setup_sects + 1) * 512 + payload_offset
    payload = bzimage[start:start + payload_length]
    if payload.startswith(b"\xfd7zXZ\x00"):
        elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    elif payload.startswith(b"\x1f\x8b"):
        elf = gzip.decompress(payload)
    elif payload.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard
        elf = zstandard.ZstdDecompressor().decompressobj().decompress(payload)
    else:
        raise ImageError(f"unknown bzImage payload compression (magic {payload[:6].hex()})")
    if not elf.startswith(b"\x7fELF\x02"):
        raise ImageError("the bzImage payload is not a 64-bit ELF kernel")
    return elf


def has_pvh_entry(elf: bytes) -> bool:
    """Whether a 64-bit ELF kernel carries the Xen PVH entry note (CONFIG_PVH), which lets
    QEMU start it directly in 32-bit protected mode: no real-mode setup, no decompression."""
    phoff = int.from_bytes(elf[0x20:0x28], "little")
    phentsize = int.from_bytes(elf[0x36:0x38], "little")
    phnum = int.from_bytes(elf[0x38:0x3A], "little")
    for idx in range(min(phnum, 64)):
        ph = elf[phoff + idx * phentsize: phoff + (idx + 1) * phentsize]
        if int.from_bytes(ph[0:4], "little") != PT_NOTE:
            continue
        offset = int.from_bytes(ph[8:16], "little")
        end = offset + int.from_bytes(ph[32:40], "little")
        while offset + 12 <= end:
            namesz, descsz, note_type = (int.from_bytes(elf[offset + i:offset + i + 4], "little")
                                         for i in (0, 4, 8))
            name = elf[offset + 12: offset + 12 + namesz]
            if name == b"Xen\0" and note_type == XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            offset += 12 + -(-namesz // 4) * 4 + -(-descsz // 4) * 4
    return False


def kernel_for_boot(bzimage: Path, boot: str) -> tuple[str, bytes, str]:
    """(file name, bytes, how it boots) of the kernel the image ships.

    "pvh": the uncompressed ELF, booted through its PVH entry; under TCG this skips ~2.5 s
    of decompression and real-mode setup per boot, for ~60 MB more on disk. Falls back to
    the bzImage when the kernel lacks the PVH note.
    """
    data = bzimage.read_bytes()
    if boot == "pvh":
        elf = extract_vmlinux(data)
        if has_pvh_entry(elf):
            return PVH_NAME, elf, "pvh"
        log.warning("kernel %s has no PVH entry note: shipping the bzImage", bzimage)
    return BZIMAGE_NAME, data, "bzimage"


# ---------------------------------------------------------------- the initramfs

def resolve_modules(modules_dir: Path, wanted: tuple[str, ...]) -> list[Path]:
    """Module files to insmod, in load order: each after its modules.dep dependencies.

    modules.dep lines are ``kernel/x/y.ko[.xz]: dep.ko ...``; a depth-first walk from each
    wanted module puts dependencies first (virtio_ring before virtio before virtio_pci).
    Modules built into the kernel (modules.builtin) are skipped.
    """
    deps: dict[str, list[str]] = {}
    for line in (modules_dir / "modules.dep").read_text().splitlines():
        target, _, rest = line.partition(":")
        deps[target] = rest.split()
    by_name = {_module_name(rel): rel for rel in deps}
    builtin_path = modules_dir / "modules.builtin"
    builtin = {_module_name(rel) for rel in builtin_path.read_text().split()} if builtin_path.exists() else set()
    order: list[str] = []

    def visit(rel: str) -> None:
        if rel in order:
            return
        for dep in deps.get(rel, []):
            visit(dep)
        order.append(rel)

    for name in wanted:
        key = name.replace("-", "_")
        if key in by_name:
            visit(by_name[key])
        elif key in builtin:
            log.debug("module %s is built into the kernel", name)
        else:
            raise ImageError(f"kernel module {name} not found in {modules_dir}")
    return [modules_dir / rel for rel in order]


def _module_name(rel: str) -> str:
    base = Path(rel).name
    for suffix in (".xz", ".zst", ".gz"):
        base = base.removesuffix(suffix)
    return base.removesuffix(".ko").replace("-", "_")


def _module_bytes(path: Path) -> bytes:
    """A module's ELF bytes: busybox insmod cannot read compressed modules, so unpack here."""
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix == ".gz":
        return gzip.decompress(data)
    if path.suffix == ".zst":
        import zstandard
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return data


class _Cpio:
    """A newc ("070701") cpio archive written in memory, as the kernel's initramfs unpacker
    reads it (Documentation/driver-api/early-userspace/buffer-format.rst). Writing it here
    gives root ownership and a /dev/console node without mknod or the cpio tool."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.ino = 1

    def _entry(self, name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> None:
        fields = [self.ino, mode, 0, 0, 2 if mode & 0o040000 else 1, 0, len(data), 0, 0,
                  rdev[0], rdev[1], len(name) + 1, 0]
        self.ino += 1
        header = b"070701" + b"".join(f"{v:08x}".encode() for v in fields)
        self.parts += [header, name.encode() + b"\0", b"\0" * (-(110 + len(name) + 1) % 4),
                       data, b"\0" * (-len(data) % 4)]

    def directory(self, name: str) -> None:
        self._entry(name, 0o040755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(name, 0o100000 | mode, data)

    def char_device(self, name: str, major: int, minor: int) -> None:
        self._entry(name, 0o020600, rdev=(major, minor))

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return b"".join(self.parts)


def build_initramfs(recipe: Recipe, recipe_dir: Path, modules_dir: Path, busybox: Path) -> bytes:
    """The zstd-compressed initramfs: static busybox, /init, the modules in load order."""
    import zstandard

    archive = _Cpio()
    for directory in ("bin", "dev", "etc", "lib", "lib/modules", "newroot", "proc", "sys"):
        archive.directory(directory)
    archive.char_device("dev/console", 5, 1)     # the kernel opens it before running /init
    archive.file("bin/busybox", busybox.read_bytes(), 0o755)
    archive.file("init", (recipe_dir / "initramfs" / "init").read_bytes(), 0o755)
    order = []
    for path in resolve_modules(modules_dir, recipe.modules):
        target = f"lib/modules/{_module_name(path.name)}.ko"
        archive.file(target, _module_bytes(path))
        order.append("/" + target)
    archive.file("etc/azq-modules", ("\n".join(order) + "\n").encode())
    return zstandard.ZstdCompressor(level=19).compress(archive.finish())


# ---------------------------------------------------------------- the root filesystem

def _inside(root: Path, rel: str) -> Path:
    """root/rel, refusing a path that a symlink in the tree would lead outside root
    (debootstrap's tree has absolute links such as var/run -> /run: followed on the host,
    they would write into the host's own directories)."""
    target = Path(os.path.realpath(root / rel))
    real_root = Path(os.path.realpath(root))
    if target != real_root and real_root not in target.parents:
        raise ImageError(f"recipe path {rel} leads outside the rootfs ({target})")
    return target


def _copy_tree(src: Path, root: Path, rel_dest: str) -> int:
    """Copy the recipe files under src to root/rel_dest, keeping modes; returns the count."""
    count = 0
    for path in _recipe_files(src):
        rel = path.relative_to(src)
        dest = _inside(root, f"{rel_dest}/{rel.as_posix()}" if rel_dest else rel.as_posix())
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.is_symlink() or dest.exists():
            dest.unlink()
        if path.is_symlink():
            dest.symlink_to(os.readlink(path))
        else:
            shutil.copy2(path, dest)
            dest.chmod(0o755 if path.stat().st_mode & 0o111 else 0o644)
        count += 1
    return count


def _prune(root: Path, recipe: Recipe) -> None:
    """Empty the recipe's prune directories; of /usr/share/doc keep only copyright files."""
    for rel in recipe.prune:
        directory = _inside(root, rel)
        if directory.is_dir() and not directory.is_symlink():
            for child in directory.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    doc = _inside(root, "usr/share/doc")
    for dirpath, dirnames, filenames in os.walk(doc, topdown=False):
        for name in filenames:
            if name != "copyright":
                (Path(dirpath) / name).unlink()
        for name in dirnames:
            sub = Path(dirpath) / name
            if sub.is_symlink():
                sub.unlink()
            elif not any(sub.iterdir()):
                sub.rmdir()
    for rel in ("etc/resolv.conf",):        # the host's, copied by debootstrap: no network here
        leftover = root / rel
        if leftover.is_symlink() or leftover.is_file():
            leftover.unlink()


READONLY_TARGET = "usr/lib/azq-readonly"


def _relocate_readonly(root: Path, recipe: Recipe) -> None:
    """Move the recipe's read-only data out of /var (copied to tmpfs at boot) into /usr."""
    for rel in recipe.readonly:
        src = _inside(root, rel)
        if not src.is_dir() or src.is_symlink():
            continue
        dest = _inside(root, f"{READONLY_TARGET}/{rel}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dest)
        src.symlink_to(f"/{READONLY_TARGET}/{rel}")


def _link(root: Path, rel: str, target: str) -> None:
    path = _inside(root, rel)
    if path.is_symlink() or path.exists():
        path.unlink()
    path.symlink_to(target)


def _install_guest_agent(root: Path, agent_dir: Path) -> int:
    """Copy guest-agent/ into the rootfs and link azq-phase onto PATH; 0 files is fine."""
    count = _copy_tree(agent_dir, root, GUEST_AGENT_TARGET) if agent_dir.is_dir() else 0
    phase = _inside(root, f"{GUEST_AGENT_TARGET}/azq-phase")
    if phase.is_file():
        phase.chmod(0o755)
        _link(root, "usr/local/bin/azq-phase", f"/{GUEST_AGENT_TARGET}/azq-phase")
    return count


def _install_workspace(root: Path, recipe_dir: Path) -> list[str]:
    """Bake images/workspace/ into /opt/azq-workspace as git repositories, tests checked.

    Each project is committed once so that an agent's `git diff` shows only its own edits,
    and its unittest suite must pass in the guest's Python before the image is accepted.
    """
    projects: list[str] = []
    src = recipe_dir / "workspace"
    _inside(root, "workspace").mkdir(exist_ok=True)     # tmpfs mount point
    if not src.is_dir():
        return projects
    _copy_tree(src, root, WORKSPACE_TARGET)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8",
           "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z"}
    for project in sorted(p for p in _inside(root, WORKSPACE_TARGET).iterdir() if p.is_dir()):
        guest_path = f"/{WORKSPACE_TARGET}/{project.name}"
        if (project / "tests").is_dir():
            # -B: no __pycache__ baked into the image (the guest makes its own on tmpfs).
            _run(["chroot", str(root), "/bin/sh", "-c", f"cd {guest_path} && python3 -B -m unittest -q"],
                 f"workspace tests of {project.name} in the guest's python3", env=env)
        if (root / "usr/bin/git").exists():
            script = (f"cd {guest_path} && git init -q && git add -A && "
                      "git commit -q -m 'workspace as baked into the guest image'")
            _run(["chroot", str(root), "/bin/sh", "-c", script], f"git init of {project.name}", env=env)
        projects.append(project.name)
    return projects


def build_rootfs_tree(recipe: Recipe, recipe_dir: Path, agent_dir: Path, root: Path, key: str,
                      progress: Progress) -> dict:
    """debootstrap, prune, overlay images/rootfs, install the agent and the workspace."""
    started = time.monotonic()
    progress(f"debootstrap {recipe.suite} ({recipe.variant} + {', '.join(recipe.include)})")
    _run(["debootstrap", f"--variant={recipe.variant}", f"--include={','.join(recipe.include)}",
          recipe.suite, str(root), recipe.mirror], "debootstrap")
    _unmount_under(root)
    debootstrap_s = time.monotonic() - started
    _prune(root, recipe)
    overlay_files = _copy_tree(recipe_dir / "rootfs", root, "")
    _relocate_readonly(root, recipe)
    _link(root, "etc/inittab", "/run/azq/inittab")      # written by azq-init at every boot
    _link(root, "etc/mtab", "../proc/self/mounts")
    if not _inside(root, "usr/sbin/init").exists():
        _link(root, "usr/sbin/init", "azq-init")
    agent_files = _install_guest_agent(root, agent_dir)
    progress(f"guest agent: {agent_files} file(s) from guest-agent/"
             + ("" if agent_files else " (none yet: the slot stays empty)"))
    projects = _install_workspace(root, recipe_dir)
    progress(f"workspace: {', '.join(projects) or 'none'} (tests pass in the guest's python3)")
    _inside(root, "etc/azq-image").write_text(f"key={key}\nbuilder={BUILDER_VERSION}\n"
                                              f"kernel={recipe.kernel_abi}\n")
    packages = _run(["chroot", str(root), "dpkg-query", "-W", "-f", "${Package}\n"],
                    "listing the rootfs packages").stdout.split()
    return {"debootstrap_s": round(debootstrap_s, 1), "overlay_files": overlay_files,
            "guest_agent_files": agent_files, "workspace_projects": projects,
            "package_count": len(packages)}


def _tree_footprint(root: Path) -> tuple[int, int]:
    """(bytes of 4 KiB blocks the files need, inode count) of a tree, hard links once."""
    seen: set[int] = set()
    blocks_bytes, inodes = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            if st.st_ino in seen:
                continue
            seen.add(st.st_ino)
            inodes += 1
            blocks_bytes += -(-max(st.st_size, 1) // 4096) * 4096
    return blocks_bytes, inodes


def make_ext4(root: Path, image: Path, slack_mib: int) -> None:
    """Pack the tree into an ext4 image file with mkfs.ext4 -d (no mount, no loop device).

    No journal (the root is only ever mounted read-only, by many VMs at once), no reserved
    blocks, inodes sized to the tree. Checked with e2fsck -fn afterwards.
    """
    data_bytes, inodes = _tree_footprint(root)
    inode_count = inodes + inodes // 10 + 1024
    # ext4 metadata beyond inode tables (bitmaps, group descriptors, directories' extra
    # blocks) stays well under 5% of the data for trees like this one.
    size_bytes = int(data_bytes * 1.05) + inode_count * 256 + (slack_mib << 20) + (8 << 20)
    size_bytes = -(-size_bytes // (1 << 20)) << 20
    if image.exists():
        image.unlink()
    _run(["mkfs.ext4", "-q", "-F", "-t", "ext4", "-b", "4096", "-N", str(inode_count), "-m", "0",
          "-O", "^has_journal", "-L", "azq-root", "-E", "root_owner=0:0", "-d", str(root),
          str(image), f"{size_bytes >> 10}k"], "mkfs.ext4 -d")
    _run(["e2fsck", "-fn", str(image)], "e2fsck of the new rootfs")


# ---------------------------------------------------------------- the build

@contextmanager
def _build_lock(cache_dir: Path, progress: Progress) -> Iterator[None]:
    """One build at a time per cache (flock: released by the kernel if the builder dies)."""
    with open(cache_dir / ".lock", "w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("another image build is running: waiting for it")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def _make_readable(path: Path) -> None:
    """0644 files, 0755 dirs: many VMs under the libvirt-qemu user read the image."""
    for dirpath, _dirnames, filenames in os.walk(path):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _check_reachable(cache_dir: Path, progress: Progress) -> None:
    """Warn when a parent directory would stop the libvirt-qemu user reaching the cache."""
    for parent in [cache_dir, *cache_dir.parents]:
        if parent.exists() and not os.stat(parent).st_mode & 0o001:
            progress(f"warning: {parent} is not searchable by other users; "
                     "libvirt's qemu user cannot open the image there")
            return


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _publish(staging: Path, cache_dir: Path, key: str) -> None:
    """Rename the finished image into place and point `current` at it, both atomically."""
    final = cache_dir / key
    if final.exists():                      # --force: move the old one aside first
        old = Path(tempfile.mkdtemp(prefix=f".old-{key}-", dir=cache_dir))
        final.rename(old / key)
        staging.rename(final)
        _remove_tree(old)
    else:
        staging.rename(final)
    link_tmp = cache_dir / f".current-{os.getpid()}"
    if link_tmp.is_symlink():
        link_tmp.unlink()
    link_tmp.symlink_to(key)
    link_tmp.rename(cache_dir / "current")


def build_image(cfg: azq_config.Config | None = None, force: bool = False,
                progress: Progress | None = None) -> GuestImage:
    """Build the image for the current recipe unless it is already in the cache.

    Needs root (debootstrap, chroot) and the network to Debian's archive. Takes about a
    minute here (debootstrap is most of it); ``progress`` receives one line per step.
    """
    say: Progress = progress or (lambda line: log.info("%s", line))
    recipe = load_recipe()
    key = recipe_key(kernel_abi=recipe.kernel_abi)
    cache_dir = _cache_dir(cfg)
    if not force:
        try:
            image = image_by_key(key, cfg)
            say(f"image up to date: {key}")
            return image
        except ImageError:
            pass
    if os.geteuid() != 0:
        raise ImageError("building the guest image needs root (debootstrap, chroot): "
                         "run 'sudo azq image build'")
    old_umask = os.umask(0o022)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        free_bytes = shutil.disk_usage(cache_dir).free
        if free_bytes < BUILD_SPACE_BYTES:
            raise ImageError(f"not enough space in {cache_dir} to build the image: need "
                             f"{BUILD_SPACE_BYTES >> 20} MiB, {free_bytes >> 20} MiB free")
        with _build_lock(cache_dir, say):
            if not force:                       # another build may have made it meanwhile
                try:
                    return image_by_key(key, cfg)
                except ImageError:
                    pass
            for stale in [*cache_dir.glob(".build-*"), *cache_dir.glob(".old-*")]:
                say(f"removing {stale.name} left by an interrupted build")
                _kill_users_of(stale)
                _remove_tree(stale)
            build_dir = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache_dir))
            try:
                with _sigterm_raises():
                    key = _build_into(build_dir, say)
                    _make_readable(build_dir / "out")
                    _publish(build_dir / "out", cache_dir, key)
            finally:
                _remove_tree(build_dir)
        os.chmod(cache_dir, 0o755)
        _check_reachable(cache_dir, say)
    finally:
        os.umask(old_umask)
    return image_by_key(key, cfg)


def _snapshot_recipe(dest: Path) -> tuple[Path, Path]:
    """Copy images/ and guest-agent/ into the build dir and build from the copy, so that
    an edit during the build (others work on guest-agent/ while images build) cannot put
    new content into an image filed under the old key."""
    recipe_dir, agent_dir = dest / "images", dest / "guest-agent"
    for src, copy in ((RECIPE_DIR, recipe_dir), (GUEST_AGENT_DIR, agent_dir)):
        copy.mkdir(parents=True)
        if src.is_dir():
            _copy_tree(src, copy, "")
    return recipe_dir, agent_dir


def _build_into(build_dir: Path, say: Progress) -> str:
    """The build proper, into build_dir/out (build_dir/work is scratch); returns the key."""
    started = time.monotonic()
    work, out = build_dir / "work", build_dir / "out"
    out.mkdir()
    recipe_dir, agent_dir = _snapshot_recipe(build_dir / "recipe")
    recipe = load_recipe(recipe_dir)
    key = recipe_key(recipe_dir, agent_dir, recipe.kernel_abi)

    def step(line: str) -> None:
        say(f"[{time.monotonic() - started:5.1f} s] {line}")

    step(f"building image {key}: kernel {recipe.kernel_package}")
    kernel_deb = _apt_download(recipe.kernel_package, work / "debs", step)
    kernel_version = _deb_version(kernel_deb)
    kernel_tree = work / "kernel"
    _run(["dpkg-deb", "-x", str(kernel_deb), str(kernel_tree)], f"unpacking {kernel_deb.name}")
    _run(["depmod", "-b", str(kernel_tree), recipe.kernel_abi], "depmod")
    kernel_name, kernel_bytes, kernel_boot = kernel_for_boot(
        kernel_tree / "boot" / f"vmlinuz-{recipe.kernel_abi}", recipe.kernel_boot)
    (out / kernel_name).write_bytes(kernel_bytes)
    del kernel_bytes

    step(f"initramfs: busybox from {recipe.busybox_package}, modules {', '.join(recipe.modules)}")
    busybox_deb = _apt_download(recipe.busybox_package, work / "debs", step)
    busybox_version = _deb_version(busybox_deb)
    busybox_tree = work / "busybox"
    _run(["dpkg-deb", "-x", str(busybox_deb), str(busybox_tree)], f"unpacking {busybox_deb.name}")
    modules_dir = kernel_tree / "lib" / "modules" / recipe.kernel_abi
    (out / INITRD_NAME).write_bytes(
        build_initramfs(recipe, recipe_dir, modules_dir, busybox_tree / "bin" / "busybox"))

    rootfs_info = build_rootfs_tree(recipe, recipe_dir, agent_dir, work / "rootfs", key, step)
    step("mkfs.ext4 -d (read-only root, no journal)")
    make_ext4(work / "rootfs", out / ROOTFS_NAME, recipe.slack_mib)
    _remove_tree(work)

    files = {}
    for role, name in (("kernel", kernel_name), ("initrd", INITRD_NAME), ("rootfs", ROOTFS_NAME)):
        path = out / name
        files[role] = {"name": name, "size_bytes": path.stat().st_size,
                       "allocated_bytes": path.stat().st_blocks * 512, "sha256": _sha256(path)}
    build_s = round(time.monotonic() - started, 1)
    manifest = {
        "magic": MANIFEST_MAGIC, "version": MANIFEST_VERSION, "key": key,
        "builder": BUILDER_VERSION, "cmdline": recipe.cmdline,
        "kernel_abi": recipe.kernel_abi, "kernel_package_version": kernel_version,
        "kernel_boot": kernel_boot,
        "busybox_package_version": busybox_version,
        "suite": recipe.suite, "include": list(recipe.include),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "build_s": build_s,
        "files": files, **rootfs_info,
    }
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    step(f"done: image {key}")
    return key
