"""Unit tests of the initramfs (azqemu.image.initramfs): module order, unpacking, the cpio archive."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image.initramfs import _module_bytes, _module_name, build_initramfs, resolve_modules
from azqemu.image.recipe import Recipe, load_recipe

from .conftest import RECIPE


def _modules_tree(tmp_path: Path) -> Path:
    mdir = tmp_path / "lib" / "modules" / "6.1.0-test"
    (mdir / "kernel").mkdir(parents=True)
    (mdir / "modules.dep").write_text(
        "kernel/drivers/virtio/virtio_ring.ko:\n"
        "kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/drivers/virtio/virtio_pci_modern_dev.ko:\n"
        "kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_modern_dev.ko "
        "kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/drivers/block/virtio_blk.ko.xz: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n"
        "kernel/lib/crc16.ko:\nkernel/fs/mbcache.ko:\nkernel/fs/jbd2/jbd2.ko:\n"
        "kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko\n")
    (mdir / "modules.builtin").write_text("kernel/crypto/crc32c_generic.ko\n")
    return mdir


def test_resolve_modules_puts_dependencies_first(tmp_path: Path) -> None:
    mdir = _modules_tree(tmp_path)
    order = resolve_modules(mdir, ("virtio_pci", "virtio_blk", "crc32c_generic", "ext4"))
    names = [_module_name(p.name) for p in order]
    assert names == ["virtio_pci_modern_dev", "virtio_ring", "virtio", "virtio_pci", "virtio_blk",
                     "crc16", "mbcache", "jbd2", "ext4"]
    with pytest.raises(ImageError, match="kernel module virtio_fs not found"):
        resolve_modules(mdir, ("virtio_fs",))


def test_compressed_modules_are_unpacked(tmp_path: Path) -> None:
    elf = b"\x7fELF" + bytes(range(64))
    packed = tmp_path / "m.ko.xz"
    packed.write_bytes(lzma.compress(elf, format=lzma.FORMAT_XZ))
    assert _module_bytes(packed) == elf


def _parse_newc(data: bytes) -> dict[str, tuple[int, int, bytes]]:
    """name -> (mode, rdev major, data) of a newc archive."""
    entries: dict[str, tuple[int, int, bytes]] = {}
    pos = 0
    while True:
        assert data[pos:pos + 6] == b"070701"
        fields = [int(data[pos + 6 + 8 * i: pos + 14 + 8 * i], 16) for i in range(13)]
        namesize, filesize = fields[11], fields[6]
        name = data[pos + 110: pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        body = data[pos: pos + filesize]
        pos += filesize + (-filesize % 4)
        if name == "TRAILER!!!":
            return entries
        entries[name] = (fields[1], fields[9], body)


def test_initramfs_archive(tmp_path: Path) -> None:
    zstandard = pytest.importorskip("zstandard")
    mdir = _modules_tree(tmp_path)
    for rel in ("drivers/virtio/virtio_ring.ko", "drivers/virtio/virtio.ko", "lib/crc16.ko",
                "fs/mbcache.ko", "fs/jbd2/jbd2.ko", "fs/ext4/ext4.ko"):
        (mdir / "kernel" / rel).parent.mkdir(parents=True, exist_ok=True)
        (mdir / "kernel" / rel).write_bytes(b"\x7fELF" + rel.encode())
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"\x7fELFbusybox")
    recipe = load_recipe(RECIPE)
    recipe = Recipe(**{**recipe.__dict__, "modules": ("virtio", "ext4")})
    packed = build_initramfs(recipe, RECIPE, mdir, busybox)
    entries = _parse_newc(zstandard.ZstdDecompressor().decompressobj().decompress(packed))
    assert entries["init"][0] == 0o100755
    assert entries["bin/busybox"][2] == b"\x7fELFbusybox"
    assert entries["dev/console"][:2] == (0o020600, 5)
    assert entries["etc/azq-modules"][2].decode().split() == [
        "/lib/modules/virtio_ring.ko", "/lib/modules/virtio.ko", "/lib/modules/crc16.ko",
        "/lib/modules/mbcache.ko", "/lib/modules/jbd2.ko", "/lib/modules/ext4.ko"]
    assert entries["lib/modules/ext4.ko"][2] == b"\x7fELFfs/ext4/ext4.ko"
