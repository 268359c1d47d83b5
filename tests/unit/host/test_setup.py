"""qemu.conf's azqemu block: added once, removed exactly, written atomically (no libvirtd needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from azqemu.errors import HostError
from azqemu.host import setup
from azqemu.host.files import write_atomic

ORIGINAL = "# user's settings\nuser = \"libvirt-qemu\"\n"


@pytest.fixture()
def conf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "qemu.conf"
    path.write_text(ORIGINAL)
    os.chmod(path, 0o600)
    monkeypatch.setattr(setup, "QEMU_CONF", path)
    return path


def test_block_added_once_and_removed_back_to_the_original(conf: Path) -> None:
    assert setup.configure_libvirt() is True
    assert setup.CONF_BLOCK in conf.read_text() and conf.read_text().startswith(ORIGINAL)
    assert setup.configure_libvirt() is False
    assert oct(conf.stat().st_mode & 0o777) == "0o600"            # the file's mode is kept
    assert setup.unconfigure_libvirt() is True
    assert conf.read_text() == ORIGINAL
    assert setup.unconfigure_libvirt() is False
    assert [p.name for p in conf.parent.iterdir()] == ["qemu.conf"]  # no temporary left


def test_a_users_own_setting_is_refused(conf: Path) -> None:
    conf.write_text(ORIGINAL + "namespaces = [ \"mount\" ]\n")
    with pytest.raises(HostError, match="already sets 'namespaces'"):
        setup.configure_libvirt()
    assert conf.read_text().endswith("namespaces = [ \"mount\" ]\n")


def test_write_atomic_replaces_whole_files(tmp_path: Path) -> None:
    path = tmp_path / "f"
    write_atomic(path, "one", 0o640)
    write_atomic(path, "two")
    assert path.read_text() == "two" and oct(path.stat().st_mode & 0o777) == "0o640"
