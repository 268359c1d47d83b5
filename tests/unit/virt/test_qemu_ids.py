"""Per-domain QEMU users: the DAC label in the domain XML, uids allocated once each from the
reserved range, the socket directory owned by that uid alone."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path

import pytest
from lxml import etree

from azqemu.errors import HostError
from azqemu.virt import domxml, identity
from azqemu.virt.identity import QEMU_UID_FIRST, QemuIds, allocate_qemu_ids, new_identity, release_qemu_uid


def _xml(qemu: QemuIds | None) -> etree._Element:
    spec = domxml.DomainSpec(ident=new_identity("c1", qemu=qemu), mem_mib=512, vcpus=1, kernel=Path("/k"),
                             initrd=Path("/i"), rootfs=Path("/r"), cmdline="", libvirt_type="qemu")
    return etree.fromstring(domxml.build(spec).encode())


def test_a_domain_with_its_own_ids_gets_a_static_dac_label_that_relabels_nothing_shared() -> None:
    root = _xml(QemuIds(QEMU_UID_FIRST + 7, 4242))
    (sec,) = root.findall("seclabel")
    # relabel='no': the kernel, initrd and root file system are every domain's.
    assert (sec.get("type"), sec.get("model"), sec.get("relabel")) == ("static", "dac", "no")
    assert sec.find("label").text == f"+{QEMU_UID_FIRST + 7}:+4242"
    assert root.find("devices/disk/source/seclabel") is None   # an override needs relabel='yes'
    # Without ids: libvirt's default user, no label of ours.
    assert _xml(None).findall("seclabel") == []


def test_uids_are_unique_under_threads_and_skip_taken_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZQ_QEMU_OWN_UIDS", "1")
    monkeypatch.setattr(identity, "qemu_group_gid", lambda: 4242)
    monkeypatch.setattr(identity, "QEMU_UID_COUNT", 64)
    monkeypatch.setattr(identity, "_live_qemu_uids", lambda: {QEMU_UID_FIRST + 1})
    taken = {QEMU_UID_FIRST + i for i in range(0, 64, 2)}       # the even ones are in records
    got: list[int] = []
    mu = threading.Lock()

    def take() -> None:
        ids = allocate_qemu_ids(taken)
        assert ids is not None
        with mu:
            got.append(ids.uid)

    threads = [threading.Thread(target=take) for _ in range(31)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 31 and not set(got) & taken and QEMU_UID_FIRST + 1 not in got
    with pytest.raises(HostError, match="no free QEMU uid"):
        allocate_qemu_ids(taken)
    release_qemu_uid(got[0])
    again = allocate_qemu_ids(taken, rng=random.Random(1))
    assert again is not None and again.uid == got[0]
    for uid in got:
        release_qemu_uid(uid)


def test_no_group_or_not_asked_for_no_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZQ_QEMU_OWN_UIDS", "1")
    monkeypatch.setattr(identity, "qemu_group_gid", lambda: None)
    assert allocate_qemu_ids([]) is None
    monkeypatch.setattr(identity, "qemu_group_gid", lambda: 4242)
    monkeypatch.setenv("AZQ_QEMU_OWN_UIDS", "0")
    assert allocate_qemu_ids([]) is None


@pytest.mark.root
def test_the_socket_dir_belongs_to_the_domains_uid_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("chown needs root")
    monkeypatch.setenv("AZQ_RUN_DIR", str(tmp_path))
    ident = new_identity("own", qemu=QemuIds(QEMU_UID_FIRST + 3, 4242))
    identity.prepare_vm_dir(ident)
    st = ident.vm_dir.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (QEMU_UID_FIRST + 3, 4242, 0o700)
    f = tmp_path / "ram.img"
    f.write_bytes(b"x")
    os.chmod(f, 0o640)
    monkeypatch.setattr(identity, "qemu_group_gid", lambda: 4242)
    identity.open_to_qemu_group(f)
    st = f.stat()
    assert (st.st_gid, st.st_mode & 0o777) == (4242, 0o660)
