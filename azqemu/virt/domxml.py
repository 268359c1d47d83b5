"""Domain XML for templates and clones.

Templates and clones must present QEMU with the same machine and the same devices, because a
clone loads the template's device state. Guest RAM is a shared memfd (``memory-backend-memfd``
with share=on, id ``pc.ram``): migration with ``x-ignore-shared`` then leaves RAM out of the
device state, and the manager can read, punch and fill it through /proc/PID/fd. The QMP
monitor is a socket of our own (see ``azqemu.virt.qmp``), added with ``<qemu:commandline>``;
libvirt marks such domains tainted ``custom-argv`` (and ``custom-monitor`` if QMP passthrough
were used), which is expected.

A domain whose identity carries its own QEMU ids (``Identity.qemu``) gets a static DAC label,
``<seclabel type='static' model='dac' relabel='no'><label>+UID:+GID</label></seclabel>``:
libvirt starts its QEMU as that uid (its own state directory goes to that uid too, and the
sockets it makes it passes as file descriptors). ``relabel='no'``, because every domain
shares the kernel, initrd and root file system: with ``relabel='yes'`` libvirt 9.0 chowns
them to each new domain's uid and, with ``remember_owner`` on, refuses the second domain
("Setting different DAC user or group on .../vmlinux which is already in use"). They are
world-readable (image/build.py); what azqemu gives the domain (its socket directory, the
template RAM image) it labels itself (identity.prepare_vm_dir, identity.open_to_qemu_group).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lxml import etree
from lxml.builder import ElementMaker

from azqemu.virt.host import AZQ_NS
from azqemu.virt.identity import Identity

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
E = ElementMaker()
Q = ElementMaker(namespace=QEMU_NS, nsmap={"qemu": QEMU_NS})
A = ElementMaker(namespace=AZQ_NS, nsmap={"azq": AZQ_NS})
GUEST_AGENT_PORT = "org.qemu.guest_agent.0"
AZQ_AGENT_PORT = "org.azqemu.agent.0"
DEFAULT_MACHINE = "pc-q35-7.2"


@dataclass
class DomainSpec:
    """What a domain is made of. ``incoming`` makes QEMU wait for device state (clones)."""

    ident: Identity
    mem_mib: int
    vcpus: int
    kernel: Path
    initrd: Path
    rootfs: Path
    cmdline: str
    libvirt_type: str            # "kvm" or "qemu" (TCG)
    machine: str = DEFAULT_MACHINE
    metadata: dict[str, str] = field(default_factory=dict)
    incoming: bool = False
    ram_backing: str = "memfd"   # "memfd" (shared) | "file-private" (copy-on-write of a file)
    env: dict[str, str] = field(default_factory=dict)
    console_log: Path | None = None
    # KSM may merge this domain's pages only where the policy asks for it (the Linux
    # configuration): KSM across sandboxes, tenants included, is a known side channel, and
    # KSM on for any reason on the host must not merge azqemu's sandboxes behind our back.
    ksm_merge: bool = False
    # TCG only: the translation cache's bound (MiB; 0 = QEMU's default); config.tcg_tb_cache_mib.
    tcg_tb_cache_mib: int = 0


def build(spec: DomainSpec) -> str:
    ident = spec.ident
    # <nosharepages/> is QEMU's mem-merge=off: no MADV_MERGEABLE on guest RAM.
    no_ksm = [] if spec.ksm_merge else [E.nosharepages()]
    if spec.ram_backing == "memfd":
        backing = E.memoryBacking(*no_ksm, E.source(type="memfd"), E.access(mode="shared"))
    elif spec.ram_backing == "file-private":
        backing = E.memoryBacking(*no_ksm, E.source(type="file"), E.access(mode="private"))
    else:
        raise ValueError(f"unknown RAM backing {spec.ram_backing!r}")
    cpu = E.cpu(mode="host-passthrough") if spec.libvirt_type == "kvm" else E.cpu(E.model("qemu64"), mode="custom", match="exact")
    tcg = ([E.tcg(E("tb-cache", str(spec.tcg_tb_cache_mib), unit="MiB"))]
           if spec.libvirt_type == "qemu" and spec.tcg_tb_cache_mib > 0 else [])
    serial = (E.serial(E.source(path=str(spec.console_log)), E.target(port="0"), type="file")
              if spec.console_log else E.serial(E.target(port="0"), type="pty"))
    devices = E.devices(
        E.emulator("/usr/bin/qemu-system-x86_64"),
        E.disk(E.driver(name="qemu", type="raw"), E.source(file=str(spec.rootfs)),
               E.target(dev="vda", bus="virtio"), E.readonly(), E.shareable(), type="file", device="disk"),
        E.controller(type="virtio-serial", index="0"),
        E.channel(E.source(mode="bind", path=str(ident.guest_agent_socket)),
                  E.target(type="virtio", name=GUEST_AGENT_PORT), type="unix"),
        E.channel(E.source(mode="bind", path=str(ident.azq_agent_socket)),
                  E.target(type="virtio", name=AZQ_AGENT_PORT), type="unix"),
        E.interface(E.mac(address=ident.mac), E.model(type="virtio"), type="user"),
        serial,
        E.memballoon(model="none"),
    )
    qemu_args = ["-qmp", f"unix:{ident.qmp_socket},server=on,wait=off"]
    if spec.incoming:
        qemu_args += ["-incoming", "defer"]
    cmdline = Q.commandline(*[Q.arg(value=a) for a in qemu_args],
                            *[Q.env(name=k, value=v) for k, v in sorted(spec.env.items())])
    seclabel = ([E.seclabel(E.label(ident.qemu.label), type="static", model="dac", relabel="no")]
                if ident.qemu is not None else [])
    dom = E.domain(
        E.name(ident.name),
        E.uuid(ident.uuid),
        E.genid(ident.genid),
        E.metadata(A.sandbox(**spec.metadata)),
        E.memory(str(spec.mem_mib), unit="MiB"),
        backing,
        E.vcpu(str(spec.vcpus)),
        E.os(E.type("hvm", arch="x86_64", machine=spec.machine), E.kernel(str(spec.kernel)),
             E.initrd(str(spec.initrd)), E.cmdline(spec.cmdline)),
        E.features(E.acpi(), *tcg),
        cpu,
        E.clock(offset="utc"),
        E.on_poweroff("destroy"), E.on_reboot("destroy"), E.on_crash("destroy"),
        devices,
        *seclabel,
        cmdline,
        type=spec.libvirt_type,
    )
    return etree.tostring(dom, pretty_print=True).decode()
