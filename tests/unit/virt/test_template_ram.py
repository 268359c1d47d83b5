"""A template's RAM image: the disk copy persists, clones use a tmpfs working copy."""

from __future__ import annotations

import os

import pytest

from azqemu import config as config_mod
from azqemu.virt.templates import TemplateRepo

PAGE = 4096


@pytest.fixture
def repo(tmp_path, monkeypatch) -> TemplateRepo:
    monkeypatch.setenv("AZQ_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("AZQ_SHM_DIR", str(tmp_path / "shm"))
    return TemplateRepo(config_mod.load())


def test_working_copy_is_made_from_the_disk_copy_sparse_and_removed_with_the_template(repo) -> None:
    disk = repo.disk_ram_path("t")
    disk.parent.mkdir(parents=True)
    (disk.parent / "meta.json").write_text("{}")
    with open(disk, "wb") as f:
        f.truncate(64 * PAGE)
        f.seek(3 * PAGE)
        f.write(b"\x07" * PAGE)
    path = repo.ram_path("t")
    assert path != disk and path.read_bytes() == disk.read_bytes()
    assert os.stat(path).st_blocks * 512 <= 2 * PAGE       # holes stay holes
    assert repo.ram_path("t") == path                       # made once
    path.unlink()                                           # a reboot emptied tmpfs
    assert repo.ram_path("t").read_bytes() == disk.read_bytes()
    repo.delete("t", [])
    assert not path.exists() and not disk.exists()


def test_zero_pages_go_back_only_from_a_working_copy_that_exists(repo) -> None:
    assert repo.give_back_zero_pages("never-made") == 0
