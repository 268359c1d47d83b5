"""The compression worker's C loops run below the guests, the rest of its work (and the GIL)
at its own value (_pagecodec.c, "Background work below the guests"; host/threads.py)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from azqemu.host import threads
from azqemu.memory import zstdlib
from azqemu.memory.pagehash import page_hashes

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread back from nice 19 needs CAP_SYS_NICE"),
    pytest.mark.skipif(not zstdlib.native_available() or not zstdlib.NATIVE_CHECKS,
                       reason="the C loops (make lib) with XXH3 are not available"),
]

PAGES = np.random.default_rng(7).integers(0, 256, size=(4096, 4096), dtype=np.uint8)   # 16 MiB


def _in_thread(fn: Callable[[], None]) -> None:
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            err.append(exc)
    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    if err:
        raise err[0]


def _hashing_below(poll: Callable[[int, int, list[int]], bool]) -> tuple[int, list[int], int, float]:
    """A thread registered to run its loops below hashes PAGES until ``poll(tid, its nice value
    seen from here, its value after each call so far)`` is true (or 20 s). Returns its own
    value, its value after each call, its value at the end, the CPU its loops ran below."""
    tid: list[int] = []
    stop = threading.Event()
    own: list[int] = []
    after: list[int] = []
    end: list[tuple[int, float]] = []

    def worker() -> None:
        own.append(threads.thread_nice())
        assert zstdlib.run_loops_below(threads.COMPRESS_NICE, own[0])
        tid.append(threading.get_native_id())
        while not stop.is_set():
            page_hashes(PAGES)
            after.append(threads.thread_nice())
        end.append((threads.thread_nice(), zstdlib.loops_below_cpu_s()))
    t = threading.Thread(target=worker)
    t.start()
    try:
        while not tid:
            pass
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:           # the poller takes the GIL the loop left
            if poll(tid[0], os.getpriority(os.PRIO_PROCESS, tid[0]), after):
                break
    finally:
        stop.set()
        t.join(30)
    assert end, "the hashing thread did not end"
    return own[0], after, end[0][0], end[0][1]


def test_a_registered_thread_runs_its_loops_below_and_gets_its_own_value_back() -> None:
    """Seen from outside while it hashes: at COMPRESS_NICE inside the loop; back at its own
    value (the one it holds the GIL at) after every call; the CPU below counted."""
    seen: set[int] = set()

    def poll(tid: int, nice: int, after: list[int]) -> bool:
        seen.add(nice)
        return threads.COMPRESS_NICE in seen and len(after) > 3
    own, after, _, below_s = _hashing_below(poll)
    assert threads.COMPRESS_NICE in seen
    assert set(after) == {own}                       # every call gave the value back
    assert below_s > 0


def test_few_pages_a_raised_thread_or_an_unregistered_one_stay_where_they_are() -> None:
    def small_batch() -> None:
        own = threads.thread_nice()
        zstdlib.run_loops_below(threads.COMPRESS_NICE, own)
        page_hashes(PAGES[:8])                       # below BG_MIN_PAGES: not worth the syscalls
        assert zstdlib.loops_below_cpu_s() == 0.0 and threads.thread_nice() == own

    def raised() -> None:
        own = threads.thread_nice()
        zstdlib.run_loops_below(threads.COMPRESS_NICE, own)
        # A canceller raised it, or it holds the store's lock: its loops stay raised.
        threads.set_thread_nice(threads.STORE_LOCK_NICE)
        page_hashes(PAGES)
        assert zstdlib.loops_below_cpu_s() == 0.0 and threads.thread_nice() == threads.STORE_LOCK_NICE

    def unregistered() -> None:
        own = threads.thread_nice()
        page_hashes(PAGES)
        assert zstdlib.loops_below_cpu_s() == 0.0 and threads.thread_nice() == own
    for body in (small_batch, raised, unregistered):
        _in_thread(body)


def test_a_worker_raised_by_a_canceller_during_a_loop_keeps_the_raise() -> None:
    """The loop ends at COMPRESS_NICE only: a value set meanwhile from outside stays."""
    def poll(tid: int, nice: int, after: list[int]) -> bool:
        if nice != threads.COMPRESS_NICE:
            return False
        assert threads.set_nice_of(tid, threads.PAUSED_GUEST_NICE)
        return True
    _, _, at_end, _ = _hashing_below(poll)
    assert at_end == threads.PAUSED_GUEST_NICE


def test_the_compression_worker_without_the_c_loops_runs_wholly_below() -> None:
    asked: list[tuple[int, int]] = []

    def with_loops() -> None:
        own = threads.thread_nice()
        threads.background_worker(lambda bg, fg: asked.append((bg, fg)) or True)
        assert threads.thread_nice() == own and asked == [(threads.COMPRESS_NICE, own)]

    def without() -> None:
        threads.background_worker(lambda bg, fg: False)
        assert threads.thread_nice() == threads.COMPRESS_NICE
        threads.background_worker(None)
        assert threads.thread_nice() == threads.COMPRESS_NICE
    _in_thread(with_loops)
    _in_thread(without)
