"""Unit tests of the image build flow (azqemu.image.build) with the build proper faked: the cache,
locking and atomic publishing run for real without root or network."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image import build
from azqemu.image.build import build_image
from azqemu.image.cache import find_image, recipe_key

from .conftest import write_fake_image


@pytest.fixture()
def fake_build(cache: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the debootstrap/mkfs build with one that writes tiny files; lets the cache,
    locking and atomic publishing run for real without root or network."""
    calls: list[Path] = []

    def build_into(build_dir: Path, say: object) -> str:
        calls.append(build_dir)
        key = recipe_key()
        staged = write_fake_image(build_dir, "out-tmp")
        staged.rename(build_dir / "out")
        for f in (build_dir / "out").iterdir():
            f.chmod(0o600)
        (build_dir / "work").mkdir(exist_ok=True)
        if os.environ.get("FAKE_BUILD_FAILS"):
            raise ImageError("mkfs.ext4 -d failed (exit 1): disk full")
        return key

    monkeypatch.setattr(build, "_build_into", build_into)
    monkeypatch.setattr(build.os, "geteuid", lambda: 0)
    monkeypatch.setattr(build, "BUILD_SPACE_BYTES", 0)
    return calls


def test_build_is_a_no_op_when_up_to_date(cache: Path) -> None:
    write_fake_image(cache, recipe_key())
    lines: list[str] = []
    built = build_image(progress=lines.append)
    assert lines == [f"image up to date: {built.key}"]


def test_build_publishes_atomically_and_readably(cache: Path, fake_build: list[Path]) -> None:
    built = build_image()
    assert built == find_image()
    assert (cache / "current").resolve() == cache / built.key
    assert [p.name for p in cache.iterdir() if p.name.startswith(".build-")] == []
    assert oct(built.rootfs.stat().st_mode & 0o777) == oct(0o644)
    assert oct(built.rootfs.parent.stat().st_mode & 0o777) == oct(0o755)
    build_image()
    assert len(fake_build) == 1                  # up to date: no second build
    build_image(force=True)
    assert len(fake_build) == 2 and find_image() == built


def test_interrupted_build_leaves_nothing(cache: Path, fake_build: list[Path],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_BUILD_FAILS", "1")
    with pytest.raises(ImageError, match="disk full"):
        build_image()
    assert sorted(p.name for p in cache.iterdir()) == [".lock"]
    with pytest.raises(ImageError, match="not built"):
        find_image()


def test_stale_build_dirs_are_swept(cache: Path, fake_build: list[Path]) -> None:
    stale = cache / ".build-0123456789abcdef-dead"
    (stale / "work" / "rootfs").mkdir(parents=True)
    lines: list[str] = []
    build_image(progress=lines.append)
    assert not stale.exists()
    assert any("left by an interrupted build" in line for line in lines)


@pytest.mark.skipif(os.geteuid() == 0, reason="the root check only shows for non-root users")
def test_build_needs_root(cache: Path) -> None:
    with pytest.raises(ImageError, match="needs root"):
        build_image(force=True)
