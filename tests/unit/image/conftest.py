"""Shared fixtures of the guest image tests: a private recipe copy, a private cache, fake cache entries."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from azqemu.config import REPO_ROOT
from azqemu.image.cache import MANIFEST_MAGIC, MANIFEST_VERSION
from azqemu.image.recipe import KERNEL_ENV

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
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    return path


def write_fake_image(cache: Path, key: str) -> Path:
    """A cache entry as build_image leaves it, with tiny files."""
    image_dir = cache / key
    image_dir.mkdir(parents=True)
    files = {}
    for role, name, body in (("kernel", "vmlinuz", b"k" * 10), ("initrd", "initrd.img", b"i" * 20),
                             ("rootfs", "rootfs.ext4", b"r" * 30)):
        (image_dir / name).write_bytes(body)
        files[role] = {"name": name, "size_bytes": len(body), "allocated_bytes": 4096,
                       "sha256": hashlib.sha256(body).hexdigest()}
    manifest = {"magic": MANIFEST_MAGIC, "version": MANIFEST_VERSION, "key": key,
                "cmdline": "console=ttyS0 root=/dev/vda ro", "files": files}
    (image_dir / "manifest.json").write_text(json.dumps(manifest))
    return image_dir

