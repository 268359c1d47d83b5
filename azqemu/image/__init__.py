"""Guest image: build, cache and find the kernel, initramfs and read-only rootfs VMs boot.

The recipe lives in images/ and the in-guest agent in guest-agent/; built images live in
``Config.image_cache_dir`` under a key hashed from the recipe's content (see cache).

Modules, one concept each:
    recipe     images/recipe.toml read and checked; the files that make up the recipe
    cache      the cache key, GuestImage, lookup by key, the manifest, pruning, publishing
    hostcmd    running host tools (apt-get, dpkg-deb, chroot, mkfs), cleaning up after them
    kernel     which kernel file the image ships: the bzImage or its PVH-bootable ELF
    initramfs  busybox, /init and the virtio/ext4 modules as a zstd newc cpio
    rootfs     debootstrap tree, overlay, agent and workspace, packed with mkfs.ext4 -d
    build      the build proper: lock, build dir, the steps above, manifest, publish
"""

from azqemu.image.build import build_image
from azqemu.image.cache import (
    NOT_BUILT,
    GuestImage,
    find_image,
    image_by_key,
    prune_images,
    read_manifest,
    recipe_key,
)
from azqemu.image.recipe import Recipe, load_recipe

__all__ = ["NOT_BUILT", "GuestImage", "Recipe", "build_image", "find_image", "image_by_key", "load_recipe",
           "prune_images", "read_manifest", "recipe_key"]
