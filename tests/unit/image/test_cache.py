"""Unit tests of the image cache (azqemu.image.cache): the key, lookup, pruning; no VM, no root."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image import cache as image_cache
from azqemu.image.cache import GuestImage, find_image, image_by_key, prune_images, recipe_key
from azqemu.image.recipe import KERNEL_ENV, load_recipe

from .conftest import write_fake_image


def key_of(dirs: tuple[Path, Path]) -> str:
    return recipe_key(*dirs)


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
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    pinned = load_recipe(recipe_copy[0]).kernel_abi
    assert recipe_key(*recipe_copy) == recipe_key(*recipe_copy, kernel_abi=pinned)
    assert recipe_key(*recipe_copy, kernel_abi="6.1.0-99-amd64") != recipe_key(*recipe_copy)
    monkeypatch.setenv(KERNEL_ENV, "6.1.0-99-amd64")
    assert load_recipe(recipe_copy[0]).kernel_abi == "6.1.0-99-amd64"


def test_missing_agent_dir_is_fine(recipe_copy: tuple[Path, Path], tmp_path: Path) -> None:
    assert key_of((recipe_copy[0], tmp_path / "no-such-dir"))


# ------------------------------------------------------------------ lookup

def test_find_image_when_missing(cache: Path) -> None:
    with pytest.raises(ImageError) as err:
        find_image()
    assert str(err.value) == "guest image not built: run 'azq image build'"


def test_find_image_for_the_current_recipe(cache: Path) -> None:
    key = recipe_key()
    image_dir = write_fake_image(cache, key)
    found = find_image()
    assert found == GuestImage(kernel=image_dir / "vmlinuz", initrd=image_dir / "initrd.img",
                               rootfs=image_dir / "rootfs.ext4", cmdline="console=ttyS0 root=/dev/vda ro",
                               key=key, size_bytes=60)
    assert image_by_key(key, verify=True) == found
    assert found.to_dict()["rootfs"] == str(image_dir / "rootfs.ext4")
    assert image_cache.read_manifest(found)["key"] == key


def test_damaged_image_is_refused(cache: Path) -> None:
    image_dir = write_fake_image(cache, "0123456789abcdef")
    (image_dir / "rootfs.ext4").write_bytes(b"short")
    with pytest.raises(ImageError, match="rootfs.ext4 has 5 bytes, manifest says 30"):
        image_by_key("0123456789abcdef")
    (image_dir / "rootfs.ext4").write_bytes(b"R" * 30)
    image_by_key("0123456789abcdef")
    with pytest.raises(ImageError, match="does not match its sha256"):
        image_by_key("0123456789abcdef", verify=True)
    (image_dir / "initrd.img").unlink()
    with pytest.raises(ImageError, match="initrd.img is missing"):
        image_by_key("0123456789abcdef")


def test_foreign_manifest_is_refused(cache: Path) -> None:
    image_dir = write_fake_image(cache, "0123456789abcdef")
    (image_dir / "manifest.json").write_text(json.dumps({"magic": "something-else", "version": 1}))
    with pytest.raises(ImageError, match="is not a version-1 azqemu image manifest"):
        image_by_key("0123456789abcdef")


# ------------------------------------------------------------------ pruning and publishing

def test_prune_keeps_what_is_used(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZQ_STATE_DIR", str(tmp_path / "state"))
    current = recipe_key()
    for key in (current, "aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb"):
        write_fake_image(cache, key)
    meta = tmp_path / "state" / "templates" / "base" / "meta.json"
    meta.parent.mkdir(parents=True)
    meta.write_text(json.dumps({"image_key": "aaaaaaaaaaaaaaaa"}))
    assert prune_images(dry_run=True) == [cache / "bbbbbbbbbbbbbbbb"]
    assert (cache / "bbbbbbbbbbbbbbbb").exists()
    assert prune_images() == [cache / "bbbbbbbbbbbbbbbb"]
    assert {p.name for p in cache.iterdir() if not p.name.startswith(".")} == {current, "aaaaaaaaaaaaaaaa"}


def test_publish_replaces_an_image_and_moves_current(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    for generation in ("old", "new"):
        staging = write_fake_image(tmp_path / generation, "out")
        cache_dir.mkdir(exist_ok=True)
        image_cache.publish(staging, cache_dir, "0123456789abcdef")
        assert not staging.exists()
    assert sorted(p.name for p in cache_dir.iterdir()) == ["0123456789abcdef", "current"]
    assert os.readlink(cache_dir / "current") == "0123456789abcdef"


# ------------------------------------------------------------------ through the CLI

def test_cli_info_without_image(cache: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "azqemu", "image", "info"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip() == "azq: guest image not built: run 'azq image build'"
    key = subprocess.run([sys.executable, "-m", "azqemu", "image", "key"], capture_output=True,
                         text=True, timeout=60)
    assert key.returncode == 0 and key.stdout.strip() == recipe_key()
