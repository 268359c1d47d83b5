"""The userfaultfd ABI spelled in azqemu.restore.uffd_abi, checked against linux/userfaultfd.h.

The hard-coded values were read from the header of Linux 6.1-6.18 (x86_64) once; the
second test compiles a C program against the installed header and compares everything
again, so a typo in either place fails loudly.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from azqemu.restore import uffd_abi as abi

SIZES = {
    "uffdio_api": 24, "uffdio_range": 16, "uffdio_register": 32, "uffdio_copy": 40,
    "uffdio_zeropage": 32, "uffdio_writeprotect": 24, "uffdio_continue": 32, "uffd_msg": 32,
}
IOCTLS = {
    "USERFAULTFD_IOC_NEW": 0xAA00,
    "UFFDIO_API": 0xC018AA3F,
    "UFFDIO_REGISTER": 0xC020AA00,
    "UFFDIO_UNREGISTER": 0x8010AA01,
    "UFFDIO_WAKE": 0x8010AA02,
    "UFFDIO_COPY": 0xC028AA03,
    "UFFDIO_ZEROPAGE": 0xC020AA04,
    "UFFDIO_WRITEPROTECT": 0xC018AA06,
    "UFFDIO_CONTINUE": 0xC020AA07,
}
OFFSETS = {
    ("uffdio_copy", "copy"): 32,
    ("uffdio_register", "ioctls"): 24,
    ("uffdio_zeropage", "zeropage"): 24,
}
CONSTANTS = {
    "UFFD_API": 0xAA, "UFFD_EVENT_PAGEFAULT": 0x12, "UFFD_EVENT_REMOVE": 0x15,
    "UFFD_EVENT_FORK": 0x13, "UFFD_EVENT_REMAP": 0x14, "UFFD_EVENT_UNMAP": 0x16,
    "UFFD_FEATURE_EVENT_REMOVE": 1 << 3, "UFFD_FEATURE_MISSING_HUGETLBFS": 1 << 4,
    "UFFD_FEATURE_MISSING_SHMEM": 1 << 5, "UFFD_FEATURE_THREAD_ID": 1 << 8,
    "UFFD_FEATURE_MINOR_SHMEM": 1 << 10, "UFFD_FEATURE_EXACT_ADDRESS": 1 << 11,
    "UFFDIO_REGISTER_MODE_MISSING": 1, "UFFDIO_REGISTER_MODE_WP": 2, "UFFDIO_REGISTER_MODE_MINOR": 4,
    "UFFDIO_COPY_MODE_DONTWAKE": 1, "UFFDIO_COPY_MODE_WP": 2, "UFFD_PAGEFAULT_FLAG_WRITE": 1,
    "UFFD_USER_MODE_ONLY": 1,
}


@pytest.mark.parametrize("name,size", sorted(SIZES.items()))
def test_struct_sizes(name: str, size: int) -> None:
    assert ctypes.sizeof(getattr(abi, name)) == size


@pytest.mark.parametrize("name,value", sorted(IOCTLS.items()))
def test_ioctl_numbers(name: str, value: int) -> None:
    assert getattr(abi, name) == value


@pytest.mark.parametrize("name,value", sorted(CONSTANTS.items()))
def test_constants(name: str, value: int) -> None:
    assert getattr(abi, name) == value


def test_field_offsets() -> None:
    for (struct, field), offset in OFFSETS.items():
        assert getattr(getattr(abi, struct), field).offset == offset
    msg = abi.uffd_msg
    assert msg.arg.offset == 8
    # The handler reads messages as u64 words; the word indices must match the layout.
    assert msg.arg.offset + abi._uffd_msg_pagefault.address.offset == abi.MSG_WORD_PF_ADDRESS * 8
    assert msg.arg.offset + abi._uffd_msg_pagefault.flags.offset == abi.MSG_WORD_PF_FLAGS * 8
    assert msg.arg.offset + abi._uffd_msg_pagefault.ptid.offset == abi.MSG_WORD_PF_PTID * 8
    assert msg.arg.offset + abi._uffd_msg_remove.start.offset == abi.MSG_WORD_REMOVE_START * 8
    assert msg.arg.offset + abi._uffd_msg_remove.end.offset == abi.MSG_WORD_REMOVE_END * 8


def test_ioc_rejects_oversized_argument() -> None:
    with pytest.raises(ValueError, match="does not fit _IOC"):
        abi._IOC(abi._IOC_READ, 0xAA, 0, 1 << 14)


def test_feature_names() -> None:
    assert abi.feature_names(0x138) == ["EVENT_REMOVE", "MISSING_HUGETLBFS", "MISSING_SHMEM", "THREAD_ID"]
    assert abi.feature_names(1 << 40) == [hex(1 << 40)]


C_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <linux/userfaultfd.h>
#ifndef USERFAULTFD_IOC_NEW
#define USERFAULTFD_IOC_NEW _IO(0xAA, 0x00)
#endif
#define S(t) printf("size %s %zu\n", #t, sizeof(struct t));
#define I(n) printf("ioctl %s %lu\n", #n, (unsigned long)(n));
#define C(n) printf("const %s %llu\n", #n, (unsigned long long)(n));
#define O(t, f) printf("offset %s.%s %zu\n", #t, #f, offsetof(struct t, f));
int main(void) {
    S(uffdio_api) S(uffdio_range) S(uffdio_register) S(uffdio_copy) S(uffdio_zeropage)
    S(uffdio_writeprotect) S(uffdio_continue) S(uffd_msg)
    I(USERFAULTFD_IOC_NEW) I(UFFDIO_API) I(UFFDIO_REGISTER) I(UFFDIO_UNREGISTER) I(UFFDIO_WAKE)
    I(UFFDIO_COPY) I(UFFDIO_ZEROPAGE) I(UFFDIO_WRITEPROTECT) I(UFFDIO_CONTINUE)
    C(UFFD_API) C(UFFD_EVENT_PAGEFAULT) C(UFFD_EVENT_REMOVE) C(UFFD_EVENT_FORK) C(UFFD_EVENT_REMAP)
    C(UFFD_EVENT_UNMAP) C(UFFD_FEATURE_EVENT_REMOVE) C(UFFD_FEATURE_MISSING_HUGETLBFS)
    C(UFFD_FEATURE_MISSING_SHMEM) C(UFFD_FEATURE_THREAD_ID) C(UFFD_FEATURE_MINOR_SHMEM)
    C(UFFD_FEATURE_EXACT_ADDRESS) C(UFFDIO_REGISTER_MODE_MISSING) C(UFFDIO_REGISTER_MODE_WP)
    C(UFFDIO_REGISTER_MODE_MINOR) C(UFFDIO_COPY_MODE_DONTWAKE) C(UFFDIO_COPY_MODE_WP)
    C(UFFD_PAGEFAULT_FLAG_WRITE) C(UFFD_USER_MODE_ONLY)
    O(uffdio_copy, copy) O(uffdio_register, ioctls) O(uffdio_zeropage, zeropage)
    O(uffd_msg, arg.pagefault.address) O(uffd_msg, arg.pagefault.flags)
    O(uffd_msg, arg.pagefault.feat.ptid) O(uffd_msg, arg.remove.start) O(uffd_msg, arg.remove.end)
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not installed")
def test_against_the_installed_header(tmp_path) -> None:
    src = tmp_path / "probe.c"
    src.write_text(C_PROBE)
    exe = tmp_path / "probe"
    built = subprocess.run(["gcc", "-o", str(exe), str(src)], capture_output=True, text=True)
    if built.returncode != 0 and "No such file" in built.stderr:
        pytest.skip("linux/userfaultfd.h not installed")
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    seen = 0
    word_of = {"arg.pagefault.address": abi.MSG_WORD_PF_ADDRESS, "arg.pagefault.flags": abi.MSG_WORD_PF_FLAGS,
               "arg.pagefault.feat.ptid": abi.MSG_WORD_PF_PTID, "arg.remove.start": abi.MSG_WORD_REMOVE_START,
               "arg.remove.end": abi.MSG_WORD_REMOVE_END}
    for line in out.splitlines():
        kind, name, value = line.split()
        if kind == "size":
            assert ctypes.sizeof(getattr(abi, name)) == int(value), name
        elif kind in ("ioctl", "const"):
            assert getattr(abi, name) == int(value), name
        elif kind == "offset":
            struct, _, field = name.partition(".")
            if struct == "uffd_msg":
                assert word_of[field] * 8 == int(value), name
            else:
                assert getattr(getattr(abi, struct), field).offset == int(value), name
        seen += 1
    assert seen == len(SIZES) + len(IOCTLS) + 19 + 8
