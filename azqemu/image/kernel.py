"""Guest kernel: which file of Debian's kernel package the image ships, and how it boots.

The kernel package holds a bzImage. With ``[kernel] boot = "pvh"`` the image ships the
uncompressed ELF inside it instead, which QEMU starts through its Xen PVH entry point;
this module extracts that ELF and checks for the entry note, falling back to the bzImage.
"""

from __future__ import annotations

import gzip
import logging
import lzma
from pathlib import Path

from azqemu.errors import ImageError

log = logging.getLogger(__name__)

BZIMAGE_NAME, PVH_NAME = "vmlinuz", "vmlinux"    # the kernel as shipped / uncompressed ELF
XEN_ELFNOTE_PHYS32_ENTRY = 18       # the PVH entry point note (include/xen/interface/elfnote.h)
PT_NOTE = 4


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The uncompressed ELF kernel inside a bzImage (as scripts/extract-vmlinux finds it).

    Boot protocol (Documentation/x86/boot.rst): setup_sects at 0x1f1; the protected-mode
    code starts at (setup_sects + 1) * 512; payload_offset (0x248) and payload_length
    (0x24c) locate the compressed vmlinux within it.
    """
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != b"HdrS":
        raise ImageError("the kernel is not a bzImage (no HdrS boot header)")
    setup_sects = bzimage[0x1F1] or 4
    payload_offset = int.from_bytes(bzimage[0x248:0x24C], "little")
    payload_length = int.from_bytes(bzimage[0x24C:0x250], "little")
    start = (setup_sects + 1) * 512 + payload_offset
    payload = bzimage[start:start + payload_length]
    if payload.startswith(b"\xfd7zXZ\x00"):
        elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(payload)
    elif payload.startswith(b"\x1f\x8b"):
        elf = gzip.decompress(payload)
    elif payload.startswith(b"\x28\xb5\x2f\xfd"):
        import zstandard
        elf = zstandard.ZstdDecompressor().decompressobj().decompress(payload)
    else:
        raise ImageError(f"unknown bzImage payload compression (magic {payload[:6].hex()})")
    if not elf.startswith(b"\x7fELF\x02"):
        raise ImageError("the bzImage payload is not a 64-bit ELF kernel")
    return elf


def has_pvh_entry(elf: bytes) -> bool:
    """Whether a 64-bit ELF kernel carries the Xen PVH entry note (CONFIG_PVH), which lets
    QEMU start it directly in 32-bit protected mode: no real-mode setup, no decompression."""
    phoff = int.from_bytes(elf[0x20:0x28], "little")
    phentsize = int.from_bytes(elf[0x36:0x38], "little")
    phnum = int.from_bytes(elf[0x38:0x3A], "little")
    for idx in range(min(phnum, 64)):
        ph = elf[phoff + idx * phentsize: phoff + (idx + 1) * phentsize]
        if int.from_bytes(ph[0:4], "little") != PT_NOTE:
            continue
        offset = int.from_bytes(ph[8:16], "little")
        end = offset + int.from_bytes(ph[32:40], "little")
        while offset + 12 <= end:
            namesz, descsz, note_type = (int.from_bytes(elf[offset + i:offset + i + 4], "little")
                                         for i in (0, 4, 8))
            name = elf[offset + 12: offset + 12 + namesz]
            if name == b"Xen\0" and note_type == XEN_ELFNOTE_PHYS32_ENTRY:
                return True
            offset += 12 + -(-namesz // 4) * 4 + -(-descsz // 4) * 4
    return False


def kernel_for_boot(bzimage: Path, boot: str) -> tuple[str, bytes, str]:
    """(file name, bytes, how it boots) of the kernel the image ships.

    "pvh": the uncompressed ELF, booted through its PVH entry; under TCG this skips ~2.5 s
    of decompression and real-mode setup per boot, for ~60 MB more on disk. Falls back to
    the bzImage when the kernel lacks the PVH note.
    """
    data = bzimage.read_bytes()
    if boot == "pvh":
        elf = extract_vmlinux(data)
        if has_pvh_entry(elf):
            return PVH_NAME, elf, "pvh"
        log.warning("kernel %s has no PVH entry note: shipping the bzImage", bzimage)
    return BZIMAGE_NAME, data, "bzimage"
