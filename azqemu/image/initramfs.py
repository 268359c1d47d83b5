"""Guest initramfs: a static busybox, the recipe's /init and the modules needed to mount root.

Debian's kernel has virtio and ext4 as modules, so the initramfs loads them before /init
switches to the read-only root on /dev/vda. This module orders the recipe's modules after
their dependencies, unpacks compressed ones (busybox insmod cannot), and writes the cpio
archive in Python, zstd-compressed.
"""

from __future__ import annotations

import gzip
import logging
import lzma
from pathlib import Path

from azqemu.errors import ImageError
from azqemu.image.recipe import Recipe

log = logging.getLogger(__name__)

INITRD_NAME = "initrd.img"


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
