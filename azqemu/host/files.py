"""Writing host configuration files so that a crash never leaves half a file.

A file that libvirtd reads (qemu.conf, its hook) is written next to itself, fsynced, renamed
over the old one (rename(2) is atomic within a filesystem) and the directory fsynced: a reader
sees the old file or the new one, never a mix, and a power cut keeps one of them.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int | None = None) -> None:
    """Replace ``path`` with ``text``; keeps the old file's mode unless ``mode`` is given."""
    if mode is None:
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o644
    tmp = path.with_name(f".{path.name}.azq-tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, text.encode())
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
