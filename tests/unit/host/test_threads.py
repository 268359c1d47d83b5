"""Thread priorities: a thread's own nice value, set, raised by another thread, restored."""

from __future__ import annotations

import os
import threading

import pytest

from azqemu.host import threads

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs CAP_SYS_NICE")


def _in_thread(fn: object) -> None:
    err: list[BaseException] = []

    def run() -> None:
        try:
            fn()  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            err.append(exc)
    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    if err:
        raise err[0]


@needs_root
def test_at_nice_runs_the_block_at_the_value_and_gives_the_old_one_back() -> None:
    def body() -> None:
        threads.set_thread_nice(threads.COMPRESS_NICE)
        with threads.at_nice(threads.PAUSED_GUEST_NICE):
            assert threads.thread_nice() == threads.PAUSED_GUEST_NICE
        assert threads.thread_nice() == threads.COMPRESS_NICE
    before = threads.thread_nice()
    _in_thread(body)
    assert threads.thread_nice() == before          # only the helper thread changed


@needs_root
def test_a_canceller_raises_a_compressing_thread_which_then_gets_its_value_back() -> None:
    tid: list[int] = []
    raised, seen = threading.Event(), []

    def compressing() -> None:
        threads.set_thread_nice(threads.COMPRESS_NICE)
        with threads.nice_restored():
            tid.append(threading.get_native_id())
            raised.wait(10)
            seen.append(threads.thread_nice())
        seen.append(threads.thread_nice())
    t = threading.Thread(target=compressing)
    t.start()
    while not tid:
        pass
    assert threads.set_nice_of(tid[0], threads.PAUSED_GUEST_NICE)
    raised.set()
    t.join(10)
    assert seen == [threads.PAUSED_GUEST_NICE, threads.COMPRESS_NICE]


def test_an_unknown_thread_is_refused_without_raising() -> None:
    assert threads.set_nice_of(2**22 + 12345, 5) is False


def _comm(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def test_a_thread_started_os_named_carries_its_python_name_to_the_kernel_cut_to_15_bytes() -> None:
    seen: dict[str, str] = {}

    def work() -> None:
        seen["comm"] = _comm(threading.get_native_id())
    t = threading.Thread(target=threads.os_named(work), name="azq-compress-worker-1")
    t.start()
    t.join(10)
    assert seen["comm"] == "azq-compress-wo"
    assert _comm(threading.get_native_id()) != "azq-compress-wo"    # the caller keeps its own


def test_a_pool_initializer_names_its_workers() -> None:
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="azq-pool", initializer=threads.name_os_thread) as pool:
        assert pool.submit(lambda: _comm(threading.get_native_id())).result(10) == "azq-pool_0"


def test_threads_are_named_exactly_or_by_prefix() -> None:
    """set_nice_of_named sets the threads of that exact name, not one whose name only begins
    with it; threads_named finds either way."""
    stop = threading.Event()
    ready = threading.Barrier(3)
    tids: dict[str, int] = {}

    def named(name: str) -> None:
        threads.name_os_thread(name)
        tids[name] = threading.get_native_id()
        ready.wait()
        stop.wait(10)
    ts = [threading.Thread(target=named, args=(n,)) for n in ("azq-t-exact", "azq-t-exact2")]
    for t in ts:
        t.start()
    try:
        ready.wait()
        pid = os.getpid()
        assert threads.threads_named(pid, "azq-t-exact") == [tids["azq-t-exact"]]
        assert threads.threads_named(pid, "azq-t-exact", prefix=True) == sorted(tids.values())
        assert threads.set_nice_of_named(pid, "azq-t-exact", 7) == 1
        assert os.getpriority(os.PRIO_PROCESS, tids["azq-t-exact"]) == 7
        assert os.getpriority(os.PRIO_PROCESS, tids["azq-t-exact2"]) != 7
    finally:
        stop.set()
        for t in ts:
            t.join(10)
    assert threads.threads_named(2**22 + 7, "azq-t-exact") == []
