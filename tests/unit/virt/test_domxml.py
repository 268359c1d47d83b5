"""Domain XML and the clone checklist, without libvirt running."""

from __future__ import annotations

from pathlib import Path

from lxml import etree

from azqemu.virt import domxml
from azqemu.virt.identity import new_identity


def _spec(name: str, **kw) -> domxml.DomainSpec:
    return domxml.DomainSpec(ident=new_identity(name), mem_mib=512, vcpus=2, kernel=Path("/k"),
                             initrd=Path("/i"), rootfs=Path("/r"), cmdline="console=ttyS0",
                             libvirt_type="qemu", metadata={"role": "sandbox", "template": "t"}, **kw)


def test_clone_identities_never_collide() -> None:
    ids = [new_identity(f"c{i}") for i in range(64)]
    for attr in ("uuid", "genid", "mac", "vm_dir"):
        values = [getattr(i, attr) for i in ids]
        assert len(set(values)) == len(values), attr
    sockets = [i.qmp_socket for i in ids] + [i.guest_agent_socket for i in ids] + [i.uffd_socket for i in ids]
    assert len(set(sockets)) == len(sockets)


def test_clone_xml_waits_for_incoming_state_and_shares_ram() -> None:
    root = etree.fromstring(domxml.build(_spec("c1", incoming=True)).encode())
    assert root.get("type") == "qemu"
    assert root.find("memoryBacking/source").get("type") == "memfd"
    assert root.find("memoryBacking/access").get("mode") == "shared"
    args = [a.get("value") for a in root.iter(f"{{{domxml.QEMU_NS}}}arg")]
    assert args[args.index("-incoming") + 1] == "defer"
    names = {c.find("target").get("name") for c in root.findall("devices/channel")}
    assert names == {domxml.GUEST_AGENT_PORT, domxml.AZQ_AGENT_PORT}
    assert root.find("devices/disk/readonly") is not None


def test_template_xml_boots_normally_and_kvm_uses_host_cpu() -> None:
    root = etree.fromstring(domxml.build(_spec("t1", incoming=False)).encode())
    assert "-incoming" not in [a.get("value") for a in root.iter(f"{{{domxml.QEMU_NS}}}arg")]
    spec = _spec("t2")
    spec.libvirt_type = "kvm"
    root = etree.fromstring(domxml.build(spec).encode())
    assert root.find("cpu").get("mode") == "host-passthrough"


def test_preload_env_is_passed_through_qemu_env() -> None:
    root = etree.fromstring(domxml.build(_spec("c2", env={"LD_PRELOAD": "/x.so"})).encode())
    envs = {e.get("name"): e.get("value") for e in root.iter(f"{{{domxml.QEMU_NS}}}env")}
    assert envs == {"LD_PRELOAD": "/x.so"}


def test_ksm_merges_a_domain_only_when_its_policy_asks() -> None:
    for backing in ("memfd", "file-private"):
        root = etree.fromstring(domxml.build(_spec("k1", ram_backing=backing)).encode())
        assert root.find("memoryBacking/nosharepages") is not None
        # libvirt's schema order: nosharepages before source and access.
        assert [c.tag for c in root.find("memoryBacking")] == ["nosharepages", "source", "access"]
    root = etree.fromstring(domxml.build(_spec("k2", ram_backing="file-private", ksm_merge=True)).encode())
    assert root.find("memoryBacking/nosharepages") is None


def test_sandbox_metadata_xml_keeps_attrs_and_labels() -> None:
    from lxml import etree

    from azqemu.virt.host import sandbox_metadata_xml

    xml = sandbox_metadata_xml({"role": "sandbox", "state": "compressed", "stored-bytes": "4096"},
                               {"task": "42", "tenant": "acme"})
    elem = etree.fromstring(xml)
    assert elem.tag == "sandbox" and elem.get("state") == "compressed" and elem.get("stored-bytes") == "4096"
    assert [(e.get("key"), e.get("value")) for e in elem.findall("label")] == [("task", "42"), ("tenant", "acme")]


def test_tcg_translation_cache_is_bounded_only_under_tcg() -> None:
    root = etree.fromstring(domxml.build(_spec("b1", tcg_tb_cache_mib=96)).encode())
    cache = root.find("features/tcg/tb-cache")
    assert cache is not None and cache.text == "96" and cache.get("unit") == "MiB"
    assert root.find("features/tcg") is not None
    assert etree.fromstring(domxml.build(_spec("b2")).encode()).find("features/tcg") is None  # 0: QEMU's own
    spec = _spec("b3", tcg_tb_cache_mib=96)
    spec.libvirt_type = "kvm"
    assert etree.fromstring(domxml.build(spec).encode()).find("features/tcg") is None
