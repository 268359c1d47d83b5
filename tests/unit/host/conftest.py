"""Fixtures of the host readers' tests."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterator

import pytest

MIB = 1 << 20


@pytest.fixture
def touched_buffer() -> Iterator[tuple[int, int]]:
    """An 8 MiB private anonymous buffer of this process, every page written: its hva range."""
    m = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(os.urandom(8 * MIB))
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    yield start, start + 8 * MIB
    # (the ctypes view pins the mmap; let the process end release it)
