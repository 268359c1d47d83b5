"""Proactive reclaim's checks: page-out of a process, the memory cgroup of a process (no VM)."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from azqemu.errors import HostError, NotRoot
from azqemu.host import reclaim


def test_pageout_checks() -> None:
    if os.geteuid() != 0:
        with pytest.raises(NotRoot):
            reclaim.pageout(os.getpid(), [(0, 4096)])
        return
    with pytest.raises(HostError, match="not page-aligned"):
        reclaim.pageout(os.getpid(), [(1, 4096)])
    # Our own private buffer, without swap: clean anonymous pages stay (nothing to write them
    # to) but the call itself is well-formed and answers with the bytes advised.
    m = mmap.mmap(-1, 1 << 20)
    m.write(b"x" * (1 << 20))
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    res = reclaim.pageout(os.getpid(), [(start, start + (1 << 20))])
    assert res.advised_bytes == 1 << 20 and res.pid == os.getpid()


def test_memory_cgroup_of_self() -> None:
    try:
        cg = reclaim.memory_cgroup_of(os.getpid())
    except HostError:
        pytest.skip("no memory cgroup on this host")
    assert cg.version in (1, 2) and cg.path.is_dir()
