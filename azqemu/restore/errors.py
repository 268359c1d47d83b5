"""Errors of the restore path (userfaultfd export, fault handler, prefetch).

Every one is a :class:`azqemu.errors.RestoreError` and carries fields, not only text::

    RestoreError
    ├── ExportUnavailable    nothing answers on the export socket (``socket_path``, ``detail``)
    ├── ExportRefused        the library inside QEMU answered ERR (``socket_path``, ``errno``,
    │                        ``errno_name``, ``detail``)
    ├── ExportProtocolError  the reply cannot be trusted (``socket_path``, ``detail``)
    ├── UffdIoctlError       an ioctl on the uffd failed (``op``, ``errno``, ``start``, ``length``)
    └── PageUnavailable      no source can produce a page that must exist (``offset``, ``detail``)
"""

from __future__ import annotations

import errno as _errno
import os

from azqemu.errors import RestoreError


class ExportUnavailable(RestoreError):
    def __init__(self, socket_path: str, detail: str) -> None:
        self.socket_path, self.detail = socket_path, detail
        super().__init__(f"no userfaultfd export at {socket_path}: {detail}")


class ExportRefused(RestoreError):
    def __init__(self, socket_path: str, errno: int, errno_name: str, detail: str) -> None:
        self.socket_path, self.errno, self.errno_name, self.detail = socket_path, errno, errno_name, detail
        super().__init__(f"userfaultfd export at {socket_path} refused: {errno_name}: {detail}")


class ExportProtocolError(RestoreError):
    def __init__(self, socket_path: str, detail: str) -> None:
        self.socket_path, self.detail = socket_path, detail
        super().__init__(f"bad reply from the userfaultfd export at {socket_path}: {detail}")


class UffdIoctlError(RestoreError):
    def __init__(self, op: str, errno: int, start: int = 0, length: int = 0) -> None:
        self.op, self.errno, self.start, self.length = op, errno, start, length
        name = _errno.errorcode.get(errno, str(errno))
        super().__init__(f"{op} [{start:#x}, +{length:#x}) failed: {name} ({os.strerror(errno)})")


class PageUnavailable(RestoreError):
    def __init__(self, offset: int, detail: str) -> None:
        self.offset, self.detail = offset, detail
        super().__init__(f"page at offset {offset:#x} cannot be restored: {detail}")
