"""Unit tests of the rootfs tree helpers (azqemu.image.rootfs) that need neither root nor debootstrap."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image.rootfs import _inside, _tree_footprint, copy_tree


def test_paths_may_not_leave_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "var").mkdir(parents=True)
    (root / "var" / "run").symlink_to("/run")           # as debootstrap leaves it
    assert _inside(root, "etc/motd") == (root / "etc" / "motd").resolve()
    with pytest.raises(ImageError, match="leads outside the rootfs"):
        _inside(root, "var/run/azq")
    with pytest.raises(ImageError, match="leads outside the rootfs"):
        _inside(root, "../elsewhere")


def test_copy_tree_keeps_modes_and_links_and_skips_droppings(tmp_path: Path) -> None:
    src, root = tmp_path / "src", tmp_path / "root"
    (src / "bin" / "__pycache__").mkdir(parents=True)
    (src / "bin" / "tool").write_text("#!/bin/sh\n")
    (src / "bin" / "tool").chmod(0o700)
    (src / "bin" / "data.txt").write_text("x")
    (src / "bin" / "data.txt").chmod(0o600)
    (src / "bin" / "link").symlink_to("tool")
    (src / "bin" / "__pycache__" / "m.pyc").write_bytes(b"")
    (src / "bin" / "old.pyc").write_bytes(b"")
    assert copy_tree(src, root, "opt/x") == 3
    dest = root / "opt" / "x" / "bin"
    assert sorted(p.name for p in dest.iterdir()) == ["data.txt", "link", "tool"]
    assert (dest / "tool").stat().st_mode & 0o777 == 0o755
    assert (dest / "data.txt").stat().st_mode & 0o777 == 0o644
    assert os.readlink(dest / "link") == "tool"


def test_tree_footprint_counts_hard_links_once(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    (root / "a").write_bytes(b"x" * 5000)
    os.link(root / "a", root / "b")
    (root / "empty").write_bytes(b"")
    assert _tree_footprint(root) == (8192 + 4096, 2)
