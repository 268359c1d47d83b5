"""Image build: the steps from the recipe to a published image, done once per cache key.

An image is built from Debian's kernel package, a busybox initramfs that loads virtio and
ext4, and a debootstrap minbase root packed with ``mkfs.ext4 -d``. Every build happens in
a temporary directory in the cache and is renamed into place, so an interrupted build
leaves nothing half-made; a build of a key the cache already holds is a no-op.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from azqemu import config as azq_config
from azqemu.errors import ImageError
from azqemu.image.cache import (
    BUILDER_VERSION,
    MANIFEST_MAGIC,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    GuestImage,
    build_lock,
    cache_dir_of,
    image_by_key,
    publish,
    recipe_key,
    sha256_file,
)
from azqemu.image.hostcmd import (
    Progress,
    apt_download,
    deb_version,
    kill_users_of,
    remove_tree,
    run,
    sigterm_raises,
)
from azqemu.image.initramfs import INITRD_NAME, build_initramfs
from azqemu.image.kernel import kernel_for_boot
from azqemu.image.recipe import GUEST_AGENT_DIR, RECIPE_DIR, load_recipe
from azqemu.image.rootfs import ROOTFS_NAME, build_rootfs_tree, copy_tree, make_ext4

log = logging.getLogger(__name__)

# Room a build needs in the cache: the unpacked rootfs tree, its image, the kernel tree.
BUILD_SPACE_BYTES = 2 << 30


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


def build_image(cfg: azq_config.Config | None = None, force: bool = False,
                progress: Progress | None = None) -> GuestImage:
    """Build the image for the current recipe unless it is already in the cache.

    Needs root (debootstrap, chroot) and the network to Debian's archive. Takes about a
    minute here (debootstrap is most of it); ``progress`` receives one line per step.
    """
    say: Progress = progress or (lambda line: log.info("%s", line))
    recipe = load_recipe()
    key = recipe_key(kernel_abi=recipe.kernel_abi)
    cache_dir = cache_dir_of(cfg)
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
        with build_lock(cache_dir, say):
            if not force:                       # another build may have made it meanwhile
                try:
                    return image_by_key(key, cfg)
                except ImageError:
                    pass
            for stale in [*cache_dir.glob(".build-*"), *cache_dir.glob(".old-*")]:
                say(f"removing {stale.name} left by an interrupted build")
                kill_users_of(stale)
                remove_tree(stale)
            build_dir = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache_dir))
            try:
                with sigterm_raises():
                    key = _build_into(build_dir, say)
                    _make_readable(build_dir / "out")
                    publish(build_dir / "out", cache_dir, key)
            finally:
                remove_tree(build_dir)
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
            copy_tree(src, copy, "")
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
    kernel_deb = apt_download(recipe.kernel_package, work / "debs", step)
    kernel_version = deb_version(kernel_deb)
    kernel_tree = work / "kernel"
    run(["dpkg-deb", "-x", str(kernel_deb), str(kernel_tree)], f"unpacking {kernel_deb.name}")
    run(["depmod", "-b", str(kernel_tree), recipe.kernel_abi], "depmod")
    kernel_name, kernel_bytes, kernel_boot = kernel_for_boot(
        kernel_tree / "boot" / f"vmlinuz-{recipe.kernel_abi}", recipe.kernel_boot)
    (out / kernel_name).write_bytes(kernel_bytes)
    del kernel_bytes

    step(f"initramfs: busybox from {recipe.busybox_package}, modules {', '.join(recipe.modules)}")
    busybox_deb = apt_download(recipe.busybox_package, work / "debs", step)
    busybox_version = deb_version(busybox_deb)
    busybox_tree = work / "busybox"
    run(["dpkg-deb", "-x", str(busybox_deb), str(busybox_tree)], f"unpacking {busybox_deb.name}")
    modules_dir = kernel_tree / "lib" / "modules" / recipe.kernel_abi
    (out / INITRD_NAME).write_bytes(
        build_initramfs(recipe, recipe_dir, modules_dir, busybox_tree / "bin" / "busybox"))

    rootfs_info = build_rootfs_tree(recipe, recipe_dir, agent_dir, work / "rootfs", key, step)
    step("mkfs.ext4 -d (read-only root, no journal)")
    make_ext4(work / "rootfs", out / ROOTFS_NAME, recipe.slack_mib)
    remove_tree(work)

    files = {}
    for role, name in (("kernel", kernel_name), ("initrd", INITRD_NAME), ("rootfs", ROOTFS_NAME)):
        path = out / name
        files[role] = {"name": name, "size_bytes": path.stat().st_size,
                       "allocated_bytes": path.stat().st_blocks * 512, "sha256": sha256_file(path)}
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
