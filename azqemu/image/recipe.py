"""Image recipe: images/recipe.toml read and checked, and the files the recipe is made of.

The recipe lives in images/ (recipe.toml, the initramfs /init, a rootfs overlay, the agent
workspace) and the in-guest agent in guest-agent/. This module reads recipe.toml into a
``Recipe`` and lists the recipe's files without build droppings: the same list feeds the
cache key (cache.recipe_key) and every copy of the recipe into a build.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from azqemu import config as azq_config
from azqemu.errors import ImageError

RECIPE_DIR = Path(os.environ.get("AZQ_IMAGE_RECIPE_DIR", azq_config.REPO_ROOT / "images"))
GUEST_AGENT_DIR = Path(os.environ.get("AZQ_GUEST_AGENT_DIR", azq_config.REPO_ROOT / "guest-agent"))
KERNEL_ENV = "AZQ_IMAGE_KERNEL"          # overrides recipe.toml's kernel ABI (part of the key)

KERNEL_BOOTS = ("pvh", "bzimage")
# Files that are never part of the recipe (build droppings of tests run on the host).
IGNORED_NAMES = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".git"}
IGNORED_SUFFIXES = (".pyc", ".pyo", "~", ".swp")


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


def recipe_files(root: Path) -> Iterator[Path]:
    """Every file under root that belongs to the recipe, sorted, build droppings left out."""
    if not root.is_dir():
        return
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in IGNORED_NAMES)
        for name in sorted(filenames):
            if name not in IGNORED_NAMES and not name.endswith(IGNORED_SUFFIXES):
                yield Path(dirpath) / name
