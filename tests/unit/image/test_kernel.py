"""Unit tests of the guest kernel choice (azqemu.image.kernel): bzImage payloads and the PVH note."""

from __future__ import annotations

import lzma
from pathlib import Path

import pytest

from azqemu.errors import ImageError
from azqemu.image.kernel import (
    PT_NOTE,
    XEN_ELFNOTE_PHYS32_ENTRY,
    extract_vmlinux,
    has_pvh_entry,
    kernel_for_boot,
)


def _elf_with_notes(notes: list[tuple[bytes, int]]) -> bytes:
    """A minimal ELF64 image with one PT_NOTE segment holding the given (name, type) notes."""
    body = b""
    for name, note_type in notes:
        name += b"\0"
        desc = b"\0" * 8
        body += (len(name).to_bytes(4, "little") + len(desc).to_bytes(4, "little")
                 + note_type.to_bytes(4, "little") + name + b"\0" * (-len(name) % 4) + desc)
    header = bytearray(64)
    header[0:5] = b"\x7fELF\x02"
    header[0x20:0x28] = (64).to_bytes(8, "little")           # e_phoff
    header[0x36:0x38] = (56).to_bytes(2, "little")           # e_phentsize
    header[0x38:0x3A] = (1).to_bytes(2, "little")            # e_phnum
    phdr = bytearray(56)
    phdr[0:4] = PT_NOTE.to_bytes(4, "little")
    phdr[8:16] = (120).to_bytes(8, "little")                 # p_offset
    phdr[32:40] = len(body).to_bytes(8, "little")            # p_filesz
    return bytes(header) + bytes(phdr) + body


def _bzimage(payload: bytes) -> bytes:
    setup_sects = 1
    data = bytearray((setup_sects + 1) * 512)
    data[0x1F1] = setup_sects
    data[0x202:0x206] = b"HdrS"
    data[0x248:0x24C] = (16).to_bytes(4, "little")           # payload_offset
    data[0x24C:0x250] = len(payload).to_bytes(4, "little")   # payload_length
    return bytes(data) + b"\0" * 16 + payload + b"trailer"


def test_pvh_kernel_is_extracted(tmp_path: Path) -> None:
    elf = _elf_with_notes([(b"Linux", 1), (b"Xen", XEN_ELFNOTE_PHYS32_ENTRY)])
    assert extract_vmlinux(_bzimage(lzma.compress(elf, format=lzma.FORMAT_XZ))) == elf
    bz = tmp_path / "vmlinuz"
    bz.write_bytes(_bzimage(lzma.compress(elf, format=lzma.FORMAT_XZ)))
    assert kernel_for_boot(bz, "pvh") == ("vmlinux", elf, "pvh")
    assert kernel_for_boot(bz, "bzimage") == ("vmlinuz", bz.read_bytes(), "bzimage")


def test_kernel_without_pvh_note_ships_the_bzimage(tmp_path: Path) -> None:
    elf = _elf_with_notes([(b"Xen", 5), (b"Linux", XEN_ELFNOTE_PHYS32_ENTRY)])
    assert not has_pvh_entry(elf)
    bz = tmp_path / "vmlinuz"
    bz.write_bytes(_bzimage(lzma.compress(elf, format=lzma.FORMAT_XZ)))
    assert kernel_for_boot(bz, "pvh")[2] == "bzimage"
    with pytest.raises(ImageError, match="not a bzImage"):
        extract_vmlinux(b"\0" * 1024)
    with pytest.raises(ImageError, match="unknown bzImage payload compression"):
        extract_vmlinux(_bzimage(b"plain"))
