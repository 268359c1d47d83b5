"""Image cache: the cache key, looking built images up, pruning, and publishing a new one.

Built images live outside the repo in ``Config.image_cache_dir`` under a key hashed from
the recipe's content, so a second build is a no-op and an edited recipe rebuilds. An image
is published by renaming a finished build dir into place, so readers never see a half-made
image; a manifest records what was built and lets a lookup notice a damaged one.

Cache layout::

    <cache>/<key>/vmlinuz  initrd.img  rootfs.ext4  manifest.json
    <cache>/current -> <key>          the last image built (for humans; code looks up by key)
    <cache>/.lock                     serialises builds
    <cache>/.build-<key>-XXXX/        a build in progress (removed on success or failure)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from azqemu import config as azq_config
from azqemu.errors import ImageError
from azqemu.image.hostcmd import Progress, remove_tree
from azqemu.image.recipe import GUEST_AGENT_DIR, RECIPE_DIR, load_recipe, recipe_files

log = logging.getLogger(__name__)

# Bump when the builder (this package) changes what it produces: it is part of every cache key.
BUILDER_VERSION = 2                 # 2: /etc/adjtime links into /run
MANIFEST_MAGIC = "azqemu-guest-image"
MANIFEST_VERSION = 1
MANIFEST_NAME = "manifest.json"
NOT_BUILT = "guest image not built: run 'azq image build'"


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
        for path in recipe_files(root):
            rel = f"{label}/{path.relative_to(root).as_posix()}"
            if path.is_symlink():
                body, kind = os.readlink(path).encode(), "l"
            else:
                body, kind = path.read_bytes(), "x" if path.stat().st_mode & 0o111 else "f"
            digest.update(f"{rel}\0{kind}\0{len(body)}\0".encode())
            digest.update(body)
    return digest.hexdigest()[:16]


def cache_dir_of(cfg: azq_config.Config | None) -> Path:
    return (cfg or azq_config.load()).image_cache_dir


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def image_by_key(key: str, cfg: azq_config.Config | None = None, verify: bool = False) -> GuestImage:
    """The image built under ``key`` (a template records the key it was made from).

    Checks the manifest's magic, version and file sizes; with ``verify`` also the sha256 of
    every file (a second or two for the rootfs).
    """
    image_dir = cache_dir_of(cfg) / key
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
        if verify and sha256_file(path) != info["sha256"]:
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
        with build_lock(cache_dir, lambda line: log.info("%s", line)):
            for path in doomed:
                remove_tree(path)
    return doomed


@contextmanager
def build_lock(cache_dir: Path, progress: Progress) -> Iterator[None]:
    """One build at a time per cache (flock: released by the kernel if the builder dies)."""
    with open(cache_dir / ".lock", "w") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress("another image build is running: waiting for it")
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        yield


def publish(staging: Path, cache_dir: Path, key: str) -> None:
    """Rename the finished image into place and point `current` at it, both atomically."""
    final = cache_dir / key
    if final.exists():                      # --force: move the old one aside first
        old = Path(tempfile.mkdtemp(prefix=f".old-{key}-", dir=cache_dir))
        final.rename(old / key)
        staging.rename(final)
        remove_tree(old)
    else:
        staging.rename(final)
    link_tmp = cache_dir / f".current-{os.getpid()}"
    if link_tmp.is_symlink():
        link_tmp.unlink()
    link_tmp.symlink_to(key)
    link_tmp.rename(cache_dir / "current")
