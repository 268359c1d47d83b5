"""Fixtures of the host readers' tests."""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Iterator

import pytest

MIB = 1 << 20


def wait_os_threads_gone(tids: list[int], timeout_s: float = 10.0) -> None:
    """Until the kernel has let go of this process's threads ``tids``: a Python join returns
    once a thread's Python part is done, a moment before its OS thread leaves /proc (a later
    test of this process would still see its name)."""
    deadline = time.monotonic() + timeout_s
    while any(os.path.exists(f"/proc/self/task/{tid}") for tid in tids):
        assert time.monotonic() < deadline, f"threads {tids} still in /proc/self/task"
        time.sleep(0.001)


@pytest.fixture
def touched_buffer() -> Iterator[tuple[int, int]]:
    """An 8 MiB private anonymous buffer of this process, every page written: its hva range."""
    m = mmap.mmap(-1, 8 * MIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.write(os.urandom(8 * MIB))
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    yield start, start + 8 * MIB
    # (the ctypes view pins the mmap; let the process end release it)
