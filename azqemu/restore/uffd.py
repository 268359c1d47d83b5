"""userfaultfd mechanics: the few ioctls the manager issues outside the fast paths.

Thin wrappers over :mod:`azqemu.restore.uffd_abi` that turn errno into
:class:`~azqemu.restore.errors.UffdIoctlError`. The handler and the prefetcher issue
UFFDIO_COPY themselves with preallocated argument buffers (no allocation per page); the
calls here are for registration, wake-ups, punching and the tests.

All ioctls act on the address space of the process that *created* the uffd (the
kernel keeps ``ctx->mm``), so a manager holding a uffd made inside QEMU registers,
wakes and copies into QEMU's addresses. Only the ``src`` of UFFDIO_COPY is read from the
caller's own memory.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform

from azqemu.restore import uffd_abi as abi
from azqemu.restore.errors import UffdIoctlError

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long

DEV_USERFAULTFD = "/dev/userfaultfd"

# fallocate(2), linux/falloc.h
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


def _ioctl(fd: int, request: int, arg: ctypes.Structure, op: str, start: int = 0, length: int = 0) -> None:
    try:
        fcntl.ioctl(fd, request, arg, True)
    except OSError as err:
        raise UffdIoctlError(op, err.errno or 0, start, length) from err


def open_dev() -> int:
    """Open /dev/userfaultfd (root: the device is 0600) for handing to the library."""
    return os.open(DEV_USERFAULTFD, os.O_RDWR | os.O_CLOEXEC)


def new_from_dev(dev_fd: int, *, nonblock: bool = True) -> int:
    """USERFAULTFD_IOC_NEW on an open /dev/userfaultfd (Linux 6.1+): a full uffd of the caller."""
    flags = os.O_CLOEXEC | (os.O_NONBLOCK if nonblock else 0)
    try:
        return fcntl.ioctl(dev_fd, abi.USERFAULTFD_IOC_NEW, flags)
    except OSError as err:
        raise UffdIoctlError("USERFAULTFD_IOC_NEW", err.errno or 0) from err


def new_syscall(*, user_mode_only: bool, nonblock: bool = True) -> int:
    """userfaultfd(2). Unprivileged callers get only UFFD_USER_MODE_ONLY when
    vm.unprivileged_userfaultfd=0; such a uffd is no use for QEMU (tests only)."""
    nr = abi.SYS_USERFAULTFD.get(platform.machine())
    if nr is None:
        raise UffdIoctlError("userfaultfd(2) on " + platform.machine(), 38)  # ENOSYS
    flags = os.O_CLOEXEC | (os.O_NONBLOCK if nonblock else 0)
    if user_mode_only:
        flags |= abi.UFFD_USER_MODE_ONLY
    fd = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(flags))
    if fd < 0:
        raise UffdIoctlError("userfaultfd(2)", ctypes.get_errno())
    return int(fd)


def api(uffd: int, features: int) -> tuple[int, int]:
    """UFFDIO_API (once per uffd): returns (features granted, ioctls bitmask)."""
    arg = abi.uffdio_api(api=abi.UFFD_API, features=features, ioctls=0)
    _ioctl(uffd, abi.UFFDIO_API, arg, "UFFDIO_API")
    return int(arg.features), int(arg.ioctls)


def register(uffd: int, start: int, length: int, mode: int = abi.UFFDIO_REGISTER_MODE_MISSING) -> int:
    """UFFDIO_REGISTER: faults in [start, start+length) of the creator's mm go to the uffd.

    Returns the bitmask of range ioctls the kernel allows there (``1 << _UFFDIO_COPY`` ...).
    """
    arg = abi.uffdio_register(range=abi.uffdio_range(start, length), mode=mode, ioctls=0)
    _ioctl(uffd, abi.UFFDIO_REGISTER, arg, "UFFDIO_REGISTER", start, length)
    return int(arg.ioctls)


def unregister(uffd: int, start: int, length: int) -> None:
    """UFFDIO_UNREGISTER; the kernel wakes every thread still waiting in the range."""
    _ioctl(uffd, abi.UFFDIO_UNREGISTER, abi.uffdio_range(start, length), "UFFDIO_UNREGISTER",
           start, length)


def wake(uffd: int, start: int, length: int) -> None:
    """UFFDIO_WAKE: threads waiting in the range retry their access (and fault again if
    the page is still missing, which queues a fresh message)."""
    _ioctl(uffd, abi.UFFDIO_WAKE, abi.uffdio_range(start, length), "UFFDIO_WAKE", start, length)


def _filling_ioctl(uffd: int, request: int, arg: ctypes.Structure, result: str, op: str,
                   start: int, length: int) -> int:
    """One of the ioctls that fill a range (COPY, CONTINUE, ZEROPAGE). The kernel writes
    the ``result`` field before failing: bytes done, or -errno if none. A call that stops
    early returns the bytes done; one that does nothing raises with the kernel's errno."""
    try:
        fcntl.ioctl(uffd, request, arg, True)
    except OSError as err:
        done = int(getattr(arg, result))
        if done > 0:
            return done
        raise UffdIoctlError(op, err.errno or 0, start, length) from err
    return length


def copy(uffd: int, dst: int, src: int, length: int, *, wake: bool = True) -> int:
    """UFFDIO_COPY (slow path, one call): returns bytes copied (EEXIST: the first page is
    there already)."""
    arg = abi.uffdio_copy(dst=dst, src=src, len=length,
                          mode=0 if wake else abi.UFFDIO_COPY_MODE_DONTWAKE, copy=0)
    return _filling_ioctl(uffd, abi.UFFDIO_COPY, arg, "copy", "UFFDIO_COPY", dst, length)


def continue_range(uffd: int, start: int, length: int, *, wake: bool = True) -> int:
    """UFFDIO_CONTINUE: map the page-cache pages behind [start, start+length) of a range
    registered in MINOR mode (no copy; in a private mapping they map read-only and a
    write copies them). Returns bytes mapped (EEXIST: the first page is mapped already;
    EFAULT: no page in the cache there, a hole of the file)."""
    arg = abi.uffdio_continue(range=abi.uffdio_range(start, length),
                              mode=0 if wake else abi.UFFDIO_CONTINUE_MODE_DONTWAKE, mapped=0)
    return _filling_ioctl(uffd, abi.UFFDIO_CONTINUE, arg, "mapped", "UFFDIO_CONTINUE", start, length)


def zeropage(uffd: int, start: int, length: int, *, wake: bool = True) -> int:
    """UFFDIO_ZEROPAGE: map the shared zero page over [start, start+length) (a write
    later allocates). Returns bytes mapped, or raises as :func:`continue_range`."""
    arg = abi.uffdio_zeropage(range=abi.uffdio_range(start, length),
                              mode=0 if wake else abi.UFFDIO_ZEROPAGE_MODE_DONTWAKE, zeropage=0)
    return _filling_ioctl(uffd, abi.UFFDIO_ZEROPAGE, arg, "zeropage", "UFFDIO_ZEROPAGE", start, length)


def punch_hole(fd: int, offset: int, length: int) -> None:
    """fallocate(PUNCH_HOLE | KEEP_SIZE) on a tmpfs/memfd file: frees the pages and
    unmaps them from every mapping (QEMU's next touch faults to the uffd if registered)."""
    rc = _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)
    if rc != 0:
        raise UffdIoctlError("fallocate(PUNCH_HOLE)", ctypes.get_errno(), offset, length)
