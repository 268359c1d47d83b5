"""The userfaultfd kernel ABI, and nothing else.

Constants, ctypes structures and ioctl numbers from ``include/uapi/linux/userfaultfd.h``
(Linux 6.1+ for ``USERFAULTFD_IOC_NEW``) and the generic ``_IOC`` encoding of
``include/uapi/asm-generic/ioctl.h`` (x86_64, arm64: 2 direction bits, 14 size bits).
Mechanics live in :mod:`azqemu.restore.uffd`; this module only spells the ABI, so that
``tests/unit/restore/test_uffd_abi.py`` can check every size and number against the C
header.
"""

from __future__ import annotations

import ctypes

# -- asm-generic/ioctl.h ----------------------------------------------------------------
_IOC_NRBITS = 8
_IOC_TYPEBITS = 8
_IOC_SIZEBITS = 14
_IOC_NRSHIFT = 0
_IOC_TYPESHIFT = _IOC_NRSHIFT + _IOC_NRBITS
_IOC_SIZESHIFT = _IOC_TYPESHIFT + _IOC_TYPEBITS
_IOC_DIRSHIFT = _IOC_SIZESHIFT + _IOC_SIZEBITS
_IOC_NONE = 0
_IOC_WRITE = 1
_IOC_READ = 2


def _IOC(direction: int, type_: int, nr: int, size: int) -> int:
    if size >= 1 << _IOC_SIZEBITS:
        raise ValueError(f"ioctl argument of {size} bytes does not fit _IOC")
    return ((direction << _IOC_DIRSHIFT) | (type_ << _IOC_TYPESHIFT)
            | (nr << _IOC_NRSHIFT) | (size << _IOC_SIZESHIFT))


def _IO(type_: int, nr: int) -> int:
    return _IOC(_IOC_NONE, type_, nr, 0)


def _IOR(type_: int, nr: int, struct: type[ctypes.Structure]) -> int:
    return _IOC(_IOC_READ, type_, nr, ctypes.sizeof(struct))


def _IOWR(type_: int, nr: int, struct: type[ctypes.Structure]) -> int:
    return _IOC(_IOC_READ | _IOC_WRITE, type_, nr, ctypes.sizeof(struct))


# -- linux/userfaultfd.h: structures ----------------------------------------------------
class uffdio_api(ctypes.Structure):
    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class uffdio_range(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class uffdio_register(ctypes.Structure):
    _fields_ = [("range", uffdio_range), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class uffdio_copy(ctypes.Structure):
    # ``copy`` is written by the kernel: bytes copied, or a negative errno if none was.
    _fields_ = [("dst", ctypes.c_uint64), ("src", ctypes.c_uint64), ("len", ctypes.c_uint64),
                ("mode", ctypes.c_uint64), ("copy", ctypes.c_int64)]


class uffdio_zeropage(ctypes.Structure):
    _fields_ = [("range", uffdio_range), ("mode", ctypes.c_uint64), ("zeropage", ctypes.c_int64)]


class uffdio_writeprotect(ctypes.Structure):
    _fields_ = [("range", uffdio_range), ("mode", ctypes.c_uint64)]


class uffdio_continue(ctypes.Structure):
    _fields_ = [("range", uffdio_range), ("mode", ctypes.c_uint64), ("mapped", ctypes.c_int64)]


class _uffd_msg_pagefault(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("flags", ctypes.c_uint64), ("address", ctypes.c_uint64), ("ptid", ctypes.c_uint32)]


class _uffd_msg_fork(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("ufd", ctypes.c_uint32)]


class _uffd_msg_remap(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("from_", ctypes.c_uint64), ("to", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _uffd_msg_remove(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64)]


class _uffd_msg_reserved(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("reserved1", ctypes.c_uint64), ("reserved2", ctypes.c_uint64),
                ("reserved3", ctypes.c_uint64)]


class _uffd_msg_arg(ctypes.Union):
    _pack_ = 1
    _fields_ = [("pagefault", _uffd_msg_pagefault), ("fork", _uffd_msg_fork),
                ("remap", _uffd_msg_remap), ("remove", _uffd_msg_remove),
                ("reserved", _uffd_msg_reserved)]


class uffd_msg(ctypes.Structure):
    """What read(2) on a uffd returns, one per event (``__attribute__((packed))``)."""

    _pack_ = 1
    _fields_ = [("event", ctypes.c_uint8), ("reserved1", ctypes.c_uint8),
                ("reserved2", ctypes.c_uint16), ("reserved3", ctypes.c_uint32),
                ("arg", _uffd_msg_arg)]


UFFD_MSG_SIZE = ctypes.sizeof(uffd_msg)  # 32
# The handler parses messages as 4 native u64 words, without ctypes on the fast path.
# Word 0 holds ``event`` in its low byte (little-endian hosts: x86_64, arm64).
MSG_WORDS = UFFD_MSG_SIZE // 8
MSG_WORD_EVENT = 0
MSG_WORD_PF_FLAGS = 1      # arg.pagefault.flags
MSG_WORD_PF_ADDRESS = 2    # arg.pagefault.address
MSG_WORD_PF_PTID = 3       # arg.pagefault.feat.ptid (low 32 bits)
MSG_WORD_REMOVE_START = 1  # arg.remove.start
MSG_WORD_REMOVE_END = 2    # arg.remove.end

# -- linux/userfaultfd.h: constants -----------------------------------------------------
UFFD_API = 0xAA
UFFDIO = 0xAA
USERFAULTFD_IOC = 0xAA

_UFFDIO_REGISTER = 0x00
_UFFDIO_UNREGISTER = 0x01
_UFFDIO_WAKE = 0x02
_UFFDIO_COPY = 0x03
_UFFDIO_ZEROPAGE = 0x04
_UFFDIO_WRITEPROTECT = 0x06
_UFFDIO_CONTINUE = 0x07
_UFFDIO_API = 0x3F

USERFAULTFD_IOC_NEW = _IO(USERFAULTFD_IOC, 0x00)
UFFDIO_API = _IOWR(UFFDIO, _UFFDIO_API, uffdio_api)
UFFDIO_REGISTER = _IOWR(UFFDIO, _UFFDIO_REGISTER, uffdio_register)
# _IOR for UNREGISTER and WAKE is the header's own historical mistake (kernel reads).
UFFDIO_UNREGISTER = _IOR(UFFDIO, _UFFDIO_UNREGISTER, uffdio_range)
UFFDIO_WAKE = _IOR(UFFDIO, _UFFDIO_WAKE, uffdio_range)
UFFDIO_COPY = _IOWR(UFFDIO, _UFFDIO_COPY, uffdio_copy)
UFFDIO_ZEROPAGE = _IOWR(UFFDIO, _UFFDIO_ZEROPAGE, uffdio_zeropage)
UFFDIO_WRITEPROTECT = _IOWR(UFFDIO, _UFFDIO_WRITEPROTECT, uffdio_writeprotect)
UFFDIO_CONTINUE = _IOWR(UFFDIO, _UFFDIO_CONTINUE, uffdio_continue)

UFFD_EVENT_PAGEFAULT = 0x12
UFFD_EVENT_FORK = 0x13
UFFD_EVENT_REMAP = 0x14
UFFD_EVENT_REMOVE = 0x15
UFFD_EVENT_UNMAP = 0x16

UFFD_PAGEFAULT_FLAG_WRITE = 1 << 0
UFFD_PAGEFAULT_FLAG_WP = 1 << 1
UFFD_PAGEFAULT_FLAG_MINOR = 1 << 2

UFFD_FEATURE_PAGEFAULT_FLAG_WP = 1 << 0
UFFD_FEATURE_EVENT_FORK = 1 << 1
UFFD_FEATURE_EVENT_REMAP = 1 << 2
UFFD_FEATURE_EVENT_REMOVE = 1 << 3
UFFD_FEATURE_MISSING_HUGETLBFS = 1 << 4
UFFD_FEATURE_MISSING_SHMEM = 1 << 5
UFFD_FEATURE_EVENT_UNMAP = 1 << 6
UFFD_FEATURE_SIGBUS = 1 << 7
UFFD_FEATURE_THREAD_ID = 1 << 8
UFFD_FEATURE_MINOR_HUGETLBFS = 1 << 9
UFFD_FEATURE_MINOR_SHMEM = 1 << 10
UFFD_FEATURE_EXACT_ADDRESS = 1 << 11
UFFD_FEATURE_WP_HUGETLBFS_SHMEM = 1 << 12

UFFDIO_REGISTER_MODE_MISSING = 1 << 0
UFFDIO_REGISTER_MODE_WP = 1 << 1
UFFDIO_REGISTER_MODE_MINOR = 1 << 2

UFFDIO_COPY_MODE_DONTWAKE = 1 << 0
UFFDIO_COPY_MODE_WP = 1 << 1
UFFDIO_ZEROPAGE_MODE_DONTWAKE = 1 << 0
UFFDIO_CONTINUE_MODE_DONTWAKE = 1 << 0

# userfaultfd(2) flag; azqemu never uses it (kernel-side accesses would get EFAULT), it is
# here so the tests can make an unprivileged uffd where the kernel allows no other.
UFFD_USER_MODE_ONLY = 1

FEATURE_NAMES = {
    UFFD_FEATURE_PAGEFAULT_FLAG_WP: "PAGEFAULT_FLAG_WP",
    UFFD_FEATURE_EVENT_FORK: "EVENT_FORK",
    UFFD_FEATURE_EVENT_REMAP: "EVENT_REMAP",
    UFFD_FEATURE_EVENT_REMOVE: "EVENT_REMOVE",
    UFFD_FEATURE_MISSING_HUGETLBFS: "MISSING_HUGETLBFS",
    UFFD_FEATURE_MISSING_SHMEM: "MISSING_SHMEM",
    UFFD_FEATURE_EVENT_UNMAP: "EVENT_UNMAP",
    UFFD_FEATURE_SIGBUS: "SIGBUS",
    UFFD_FEATURE_THREAD_ID: "THREAD_ID",
    UFFD_FEATURE_MINOR_HUGETLBFS: "MINOR_HUGETLBFS",
    UFFD_FEATURE_MINOR_SHMEM: "MINOR_SHMEM",
    UFFD_FEATURE_EXACT_ADDRESS: "EXACT_ADDRESS",
    UFFD_FEATURE_WP_HUGETLBFS_SHMEM: "WP_HUGETLBFS_SHMEM",
}


def feature_names(features: int) -> list[str]:
    """Names of the feature bits set in ``features`` (unknown bits as hex)."""
    names = [name for bit, name in FEATURE_NAMES.items() if features & bit]
    unknown = features & ~sum(FEATURE_NAMES)
    if unknown:
        names.append(hex(unknown))
    return names


# -- userfaultfd(2) syscall numbers, for the tests' unprivileged fallback ------------
SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
