"""Unit tests of the guest image recipe and cache (azqemu.image): no VM, no root, no network."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from azqemu import image
from azqemu.config import REPO_ROOT
from azqemu.errors import ImageError

RECIPE = REPO_ROOT / "images"


@pytest.fixture()
def recipe_copy(tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of images/ and a small guest-agent/ to edit."""
    recipe_dir, agent_dir = tmp_path / "images", tmp_path / "guest-agent"
    shutil.copytree(RECIPE, recipe_dir, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    agent_dir.mkdir()
    (agent_dir / "azq_guest_agent.py").write_text("print('agent')\n")
    return recipe_dir, agent_dir


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("AZQ_IMAGE_CACHE", str(path))
    monkeypatch.delenv(image.KERNEL_ENV, raising=False)
    return path


def key_of(dirs: tuple[Path, Path]) -> str:
    return image.recipe_key(*dirs)


# ------------------------------------------------------------------ cache key

def test_key_is_stable_for_the_same_content(recipe_copy: tuple[Path, Path], tmp_path: Path) -> None:
    first = key_of(recipe_copy)
    assert first == key_of(recipe_copy)
    assert len(first) == 16 and int(first, 16) >= 0
    # Another checkout of the same recipe (new mtimes, new location) gives the same key.
    other = (tmp_path / "again" / "images", tmp_path / "again" / "guest-agent")
    shutil.copytree(recipe_copy[0], other[0])
    shutil.copytree(recipe_copy[1], other[1])
    os.utime(other[0] / "recipe.toml", (1, 1))
    assert key_of(other) == first


def test_key_ignores_build_droppings(recipe_copy: tuple[Path, Path]) -> None:
    before = key_of(recipe_copy)
    pycache = recipe_copy[0] / "workspace" / "tally" / "tally" / "__pycache__"
    pycache.mkdir(exist_ok=True)
    (pycache / "table.cpython-311.pyc").write_bytes(b"\0" * 16)
    (recipe_copy[1] / "azq_guest_agent.pyc").write_bytes(b"x")
    assert key_of(recipe_copy) == before


@pytest.mark.parametrize("edit", ["change", "add", "remove", "chmod", "agent", "agent-add"])
def test_key_changes_when_the_recipe_changes(recipe_copy: tuple[Path, Path], edit: str) -> None:
    recipe_dir, agent_dir = recipe_copy
    before = key_of(recipe_copy)
    init = recipe_dir / "rootfs" / "usr" / "sbin" / "azq-init"
    if edit == "change":
        (recipe_dir / "workspace" / "tally" / "tally" / "table.py").write_text("# edited\n")
    elif edit == "add":
        (recipe_dir / "rootfs" / "etc" / "motd").write_text("hello\n")
    elif edit == "remove":
        (recipe_dir / "workspace" / "tally" / "data" / "notes.txt").unlink()
    elif edit == "chmod":
        init.chmod(0o644)
    elif edit == "agent":
        (agent_dir / "azq_guest_agent.py").write_text("print('agent v2')\n")
    elif edit == "agent-add":
        (agent_dir / "azq-phase").write_text("#!/bin/sh\n")
    assert key_of(recipe_copy) != before


def test_key_follows_the_kernel(recipe_copy: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(image.KERNEL_ENV, raising=False)
    pinned = image.load_recipe(recipe_copy[0]).kernel_abi
    assert image.recipe_key(*recipe_copy) == image.recipe_key(*recipe_copy, kernel_abi=pinned)
    assert image.recipe_key(*recipe_copy, kernel_abi="6.1.0-99-amd64") != image.recipe_key(*recipe_copy)
    monkeypatch.setenv(image.KERNEL_ENV, "6.1.0-99-amd64")
    assert image.load_recipe(recipe_copy[0]).kernel_abi == "6.1.0-99-amd64"


def test_missing_agent_dir_is_fine(recipe_copy: tuple[Path, Path], tmp_path: Path) -> None:
    assert key_of((recipe_copy[0], tmp_path / "no-such-dir"))


# ------------------------------------------------------------------ recipe

def test_recipe_cmdline_and_modules() -> None:
    recipe = image.load_recipe(RECIPE)
    words = recipe.cmdline.split()
    assert {"console=ttyS0", "root=/dev/vda", "ro"} <= set(words)
    assert recipe.kernel_package.startswith("linux-image-")
    mods = list(recipe.modules)
    for before, after in [("virtio_ring", "virtio"), ("virtio", "virtio_pci"), ("virtio_pci", "virtio_blk"),
                          ("crc32c_generic", "ext4"), ("jbd2", "ext4")]:
        assert mods.index(before) < mods.index(after)


def test_bad_recipe_is_one_clear_error(recipe_copy: tuple[Path, Path]) -> None:
    toml = recipe_copy[0] / "recipe.toml"
    toml.write_text(toml.read_text().replace("console=ttyS0 ", ""))
    with pytest.raises(ImageError, match="kernel cmdline lacks 'console=ttyS0'"):
        image.load_recipe(recipe_copy[0])
    toml.write_text("[kernel]\n")
    with pytest.raises(ImageError, match="bad image recipe"):
        image.load_recipe(recipe_copy[0])
    with pytest.raises(ImageError, match="image recipe not found"):
        image.load_recipe(recipe_copy[0] / "nowhere")


# ------------------------------------------------------------------ lookup

def test_find_image_when_missing(cache: Path) -> None:
    with pytest.raises(ImageError) as err:
        image.find_image()
    assert str(err.value) == "guest image not built: run 'azq image build'"


def _fake_image(cache: Path, key: str) -> Path:
    """A cache entry as build_image leaves it, with tiny files."""
    image_dir = cache / key
    image_dir.mkdir(parents=True)
    files = {}
    for role, name, body in (("kernel", "vmlinuz", b"k" * 10), ("initrd", "initrd.img", b"i" * 20),
                             ("rootfs", "rootfs.ext4", b"r" * 30)):
        (image_dir / name).write_bytes(body)
        files[role] = {"name": name, "size_bytes": len(body), "allocated_bytes": 4096,
                       "sha256": hashlib.sha256(body).hexdigest()}
    manifest = {"magic": image.MANIFEST_MAGIC, "version": image.MANIFEST_VERSION, "key": key,
                "cmdline": "console=ttyS0 root=/dev/vda ro", "files": files}
    (image_dir / "manifest.json").write_text(json.dumps(manifest))
    return image_dir


def test_find_image_for_the_current_recipe(cache: Path) -> None:
    key = image.recipe_key()
    image_dir = _fake_image(cache, key)
    found = image.find_image()
    assert found == image.GuestImage(kernel=image_dir / "vmlinuz", initrd=image_dir / "initrd.img",
                                     rootfs=image_dir / "rootfs.ext4", cmdline="console=ttyS0 root=/dev/vda ro",
                                     key=key, size_bytes=60)
    assert image.image_by_key(key, verify=True) == found
    assert found.to_dict()["rootfs"] == str(image_dir / "rootfs.ext4")


def test_build_is_a_no_op_when_up_to_date(cache: Path) -> None:
    _fake_image(cache, image.recipe_key())
    lines: list[str] = []
    built = image.build_image(progress=lines.append)
    assert lines == [f"image up to date: {built.key}"]


def test_damaged_image_is_refused(cache: Path) -> None:
    image_dir = _fake_image(cache, "0123456789abcdef")
    (image_dir / "rootfs.ext4").write_bytes(b"short")
    with pytest.raises(ImageError, match="rootfs.ext4 has 5 bytes, manifest says 30"):
        image.image_by_key("0123456789abcdef")
    (image_dir / "rootfs.ext4").write_bytes(b"R" * 30)
    image.image_by_key("0123456789abcdef")
    with pytest.raises(ImageError, match="does not match its sha256"):
        image.image_by_key("0123456789abcdef", verify=True)
    (image_dir / "initrd.img").unlink()
    with pytest.raises(ImageError, match="initrd.img is missing"):
        image.image_by_key("0123456789abcdef")


def test_foreign_manifest_is_refused(cache: Path) -> None:
    image_dir = _fake_image(cache, "0123456789abcdef")
    (image_dir / "manifest.json").write_text(json.dumps({"magic": "something-else", "version": 1}))
    with pytest.raises(ImageError, match="is not a version-1 azqemu image manifest"):
        image.image_by_key("0123456789abcdef")


# ------------------------------------------------------------------ build flow (the build proper faked)

@pytest.fixture()
def fake_build(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the debootstrap/mkfs build with one that writes tiny files; lets the cache,
    locking and atomic publishing run for real without root or network."""
    calls: list[Path] = []

    def build_into(build_dir: Path, say: object) -> str:
        calls.append(build_dir)
        key = image.recipe_key()
        staged = _fake_image(build_dir, "out-tmp")
        staged.rename(build_dir / "out")
        for f in (build_dir / "out").iterdir():
            f.chmod(0o600)
        (build_dir / "work").mkdir(exist_ok=True)
        if os.environ.get("FAKE_BUILD_FAILS"):
            raise ImageError("mkfs.ext4 -d failed (exit 1): disk full")
        return key

    monkeypatch.setattr(image, "_build_into", build_into)
    monkeypatch.setattr(image.os, "geteuid", lambda: 0)
    monkeypatch.setattr(image, "BUILD_SPACE_BYTES", 0)
    return calls


def test_build_publishes_atomically_and_readably(cache: Path, fake_build: list[Path]) -> None:
    built = image.build_image()
    assert built == image.find_image()
    assert (cache / "current").resolve() == cache / built.key
    assert [p.name for p in cache.iterdir() if p.name.startswith(".build-")] == []
    assert oct(built.rootfs.stat().st_mode & 0o777) == oct(0o644)
    assert oct(built.rootfs.parent.stat().st_mode & 0o777) == oct(0o755)
    image.build_image()
    assert len(fake_build) == 1                  # up to date: no second build
    image.build_image(force=True)
    assert len(fake_build) == 2 and image.find_image() == built


def test_interrupted_build_leaves_nothing(cache: Path, fake_build: list[Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_BUILD_FAILS", "1")
    with pytest.raises(ImageError, match="disk full"):
        image.build_image()
    assert sorted(p.name for p in cache.iterdir()) == [".lock"]
    with pytest.raises(ImageError, match="not built"):
        image.find_image()


def test_stale_build_dirs_are_swept(cache: Path, fake_build: list[Path]) -> None:
    stale = cache / ".build-0123456789abcdef-dead"
    (stale / "work" / "rootfs").mkdir(parents=True)
    lines: list[str] = []
    image.build_image(progress=lines.append)
    assert not stale.exists()
    assert any("left by an interrupted build" in line for line in lines)


def test_prune_keeps_what_is_used(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZQ_STATE_DIR", str(tmp_path / "state"))
    current = image.recipe_key()
    for key in (current, "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"):
        _fake_image(cache, key)
    meta = tmp_path / "state" / "templates" / "base" / "meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"image_key": "aaaaaaaaaaaaaaaa"}))
    assert image.prune_images(dry_run=True) == [cache / "bbbbbbbbbbbbbbbb"]
    assert (cache / "bbbbbbbbbbbbbbbb").exists()
    assert image.prune_images() == [cache / "bbbbbbbbbbbbbbbb"]
    assert {p.name for p in cache.iterdir() if not p.name.startswith(".")} == {current, "aaaaaaaaaaaaaaaa"}


@pytest.mark.skipif(os.geteuid() == 0, reason="the root check only shows for non-root users")
def test_build_needs_root(cache: Path) -> None:
    with pytest.raises(ImageError, match="needs root"):
        image.build_image(force=True)


# ------------------------------------------------------------------ kernel

def _elf_with_notes(notes: list[tuple[bytes, int]]) -> bytes:
    """A minimal ELF64 image with one PT_NOTE segment holding the given (name, type) notes."""
    body = b""
    for name, note_type in notes:
        name += b"\0"
        desc = b"\0" * 8
        body += (len(name).to_bytes(4, "little") + len(desc).to_bytes(4, "little")
                 + note_type.to_bytes(4, "little") + name + b"\0" * (-len(name) % 4) + desc)
    header = bytearray(64)
    header[0:5] = b"\x7fELF\x02"
    header[0x20:0x28] = (64).to_bytes(8, "little")           # e_phoff
    header[0x36:0x38] = (56).to_bytes(2, "little")           # e_phentsize
    header[0x38:0x3A] = (1).to_bytes(2, "little")            # e_phnum
    phdr = bytearray(56)
    phdr[0:4] = image.PT_NOTE.to_bytes(4, "little")
    phdr[8:16] = (120).to_bytes(8, "little")                 # p_offset
    phdr[32:40] = len(body).to_bytes(8, "little")            # p_filesz
    return bytes(header) + bytes(phdr) + body


def _bzimage(payload: bytes) -> bytes:
    setup_sects = 1
    data = bytearray((setup_sects + 1) * 512)
    data[0x1F1] = setup_sects
    data[0x202:0x206] = b"HdrS"
    data[0x248:0x24C] = (16).to_bytes(4, "little")           # payload_offset
    data[0x24C:0x250] = len(payload).to_bytes(4, "little")   # payload_length
    return bytes(data) + b"\0" * 16 + payload + b"trailer"


def test_pvh_kernel_is_extracted(tmp_path: Path) -> None:
    elf = _elf_with_notes([(b"Linux", 1), (b"Xen", image.XEN_ELFNOTE_PHYS32_ENTRY)])
    assert image.extract_vmlinux(_bzimage(lzma.compress(elf, format=lzma.FORMAT_XZ))) == elf
    bz = tmp_path / "vmlinuz"
    bz.write_bytes(_bzimage(lzma.compress(elf, format=lzma.FORMAT_XZ)))
    assert image.kernel_for_boot(bz, "pvh") == ("vmlinux", elf, "pvh")
    assert image.kernel_for_boot(bz, "bzimage") == ("vmlinuz", bz.read_bytes(), "bzimage")


def test_kernel_without_pvh_note_ships_the_bzimage(tmp_path: Path) -> None:
    elf = _elf_with_notes([(b"Xen", 5), (b"Linux", image.XEN_ELFNOTE_PHYS32_ENTRY)])
    assert not image.has_pvh_entry(elf)
    bz = tmp_path / "vmlinuz"
    bz.write_bytes(_bzimage(lzma.compress(elf, format=lzma.FORMAT_XZ)))
    assert image.kernel_for_boot(bz, "pvh")[2] == "bzimage"
    with pytest.raises(ImageError, match="not a bzImage"):
        image.extract_vmlinux(b"\0" * 1024)
    with pytest.raises(ImageError, match="unknown bzImage payload compression"):
        image.extract_vmlinux(_bzimage(b"plain"))


# ------------------------------------------------------------------ initramfs pieces

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
    order = image.resolve_modules(mdir, ("virtio_pci", "virtio_blk", "crc32c_generic", "ext4"))
    names = [image._module_name(p.name) for p in order]
    assert names == ["virtio_pci_modern_dev", "virtio_ring", "virtio", "virtio_pci", "virtio_blk",
                     "crc16", "mbcache", "jbd2", "ext4"]
    with pytest.raises(ImageError, match="kernel module virtio_fs not found"):
        image.resolve_modules(mdir, ("virtio_fs",))


def test_compressed_modules_are_unpacked(tmp_path: Path) -> None:
    elf = b"\x7fELF" + bytes(range(64))
    packed = tmp_path / "m.ko.xz"
    packed.write_bytes(lzma.compress(elf, format=lzma.FORMAT_XZ))
    assert image._module_bytes(packed) == elf


def _parse_newc(data: bytes) -> dict[str, tuple[int, int, bytes]]:
    """name -> (mode, rdev major, data) of a newc archive."""
    entries, pos = {}, 0
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
    recipe = image.load_recipe(RECIPE)
    recipe = image.Recipe(**{**recipe.__dict__, "modules": ("virtio", "ext4")})
    packed = image.build_initramfs(recipe, RECIPE, mdir, busybox)
    entries = _parse_newc(zstandard.ZstdDecompressor().decompressobj().decompress(packed))
    assert entries["init"][0] == 0o100755
    assert entries["bin/busybox"][2] == b"\x7fELFbusybox"
    assert entries["dev/console"][:2] == (0o020600, 5)
    assert entries["etc/azq-modules"][2].decode().split() == [
        "/lib/modules/virtio_ring.ko", "/lib/modules/virtio.ko", "/lib/modules/crc16.ko",
        "/lib/modules/mbcache.ko", "/lib/modules/jbd2.ko", "/lib/modules/ext4.ko"]
    assert entries["lib/modules/ext4.ko"][2] == b"\x7fELFfs/ext4/ext4.ko"


# ------------------------------------------------------------------ recipe contents

@pytest.mark.parametrize("script", ["initramfs/init", "rootfs/usr/sbin/azq-init",
                                    "rootfs/usr/local/sbin/azq-respawn", "rootfs/usr/sbin/shutdown"])
def test_shell_scripts_parse_and_are_executable(script: str) -> None:
    path = RECIPE / script
    assert path.stat().st_mode & 0o111, f"{script} must be executable"
    shell = shutil.which("busybox") or shutil.which("dash") or "/bin/sh"
    argv = [shell, "sh", "-n", str(path)] if shell.endswith("busybox") else [shell, "-n", str(path)]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_guest_init_starts_the_agents() -> None:
    init = (RECIPE / "rootfs" / "usr" / "sbin" / "azq-init").read_text()
    assert "qemu-ga -m virtio-serial -p $QGA_PORT" in init
    assert "QGA_PORT=/dev/virtio-ports/org.qemu.guest_agent.0" in init
    assert "AGENT=/usr/local/lib/azq-agent/azq_guest_agent.py" in init
    assert "AGENT_PORT=/dev/virtio-ports/org.azqemu.agent.0" in init
    assert 'say "ready' in init


def test_workspace_suite_passes_on_the_host() -> None:
    project = RECIPE / "workspace" / "tally"
    result = subprocess.run([sys.executable, "-B", "-m", "unittest", "-q"], cwd=project,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = sum(len(p.read_text().splitlines()) for p in project.rglob("*.py"))
    assert 300 <= lines <= 800


def test_cli_info_without_image(cache: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "azqemu", "image", "info"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == "azq: guest image not built: run 'azq image build'"
    key = subprocess.run([sys.executable, "-m", "azqemu", "image", "key"], capture_output=True,
                         text=True, timeout=60)
    assert key.returncode == 0 and key.stdout.strip() == image.recipe_key()
