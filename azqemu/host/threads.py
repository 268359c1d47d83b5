"""Thread priority and names: the one place azqemu sets a thread's nice value or OS name.

Linux schedules threads, and setpriority(2) with PRIO_PROCESS and a thread id (or 0, the
calling thread) changes that thread only, not its process (Linux semantics, not POSIX).
Fault handlers run above the guests (a vCPU waits on every fault), compression below them
(it is background work), and helper threads take the priority of the thread they serve.
Each thread the manager starts carries its name to the kernel (``os_named``), so that
``top -H -p <manager pid>`` and /proc show which of them takes the CPU.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")

# A vCPU waits while its fault is served: the handler must win the CPU from the guests that
# keep the host's cores busy (a wake-up a scheduler slice late is milliseconds).
FAULT_HANDLER_NICE = -10
# Compression is background work: on a small host it must not take CPU from the vCPUs of
# sandboxes running tool calls (nor from the fault handlers). Measured at 16 sandboxes on
# 2 cores (host 82% busy): every CPU second the manager takes shows in the guests' tool
# calls. The lowest nice value (not SCHED_IDLE, which could leave a compression unfinished for
# a whole wait on a busy host); a compression a tool call cancels is raised first
# (PAUSED_GUEST_NICE), so its low priority never delays the call. Its C loops alone can run
# this low, the rest above the guests (``background_worker``): a trade, measured, off.
COMPRESS_NICE = 19
# Work a paused guest waits for (a trim in a tool call, a compression a tool call cancelled):
# above the guests, as a fault is.
PAUSED_GUEST_NICE = FAULT_HANDLER_NICE
# The manager's own threads (requests, the scheduler, the agent links, the metadata writer)
# run above the guests: each holds the GIL in turn, and a holder the scheduler left waiting
# behind busy vCPUs holds up every other Python thread, among them one that holds the page
# store's lock that the fault threads wait for (service-agent at 8 sandboxes, one round each:
# the fault side waited 9.9 s on that lock at nice 0, 8.8 s above the guests; single rounds).
MANAGER_NICE = -5
# A thread holding the page store's lock (memory/nativestore.py) holds up every fault thread
# that needs it: it runs just above them until it lets go, whatever it was (a compression
# worker at COMPRESS_NICE that lost the CPU to busy guests with the lock held stalled faults
# for up to 0.4 s). One step above them, so that its release can tell its own boost from a
# canceller's raise to PAUSED_GUEST_NICE, which stays. Set and given back in C, with the GIL
# released (memory/_storeview.c).
STORE_LOCK_NICE = FAULT_HANDLER_NICE - 1


def thread_nice() -> int:
    """The calling thread's nice value (getpriority(2) with 0 names the calling thread)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except OSError:
        return 0


def set_thread_nice(nice: int) -> bool:
    """Set the calling thread's nice value; raising it needs CAP_SYS_NICE (the manager, root,
    has it). Returns False (and logs) where the kernel refuses."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        return True
    except OSError as exc:
        log.debug("cannot set this thread's nice value to %d: %s", nice, exc)
        return False


def background_worker(run_loops_below: Callable[[int, int], bool] | None) -> None:
    """Make the calling thread a background worker (the compression worker's initializer): at
    COMPRESS_NICE. With ``run_loops_below`` (memory/zstdlib.py; the daemon passes it under
    AZQ_COMPRESS_LOOPS_BELOW=1) only its C loops run there, with the GIL released, and the
    rest at the thread's own value: a thread at 19 that holds the GIL when busy guests take its
    CPU holds up every Python thread, among them the store lock's holder that the fault threads
    wait for. Measured as a trade (docs/figures.md, session 26): service-agent at 8 sandboxes,
    the fault side's waits for that lock 11.1 to 6.6 s a round and tool-call time unchanged;
    coding-agent at 16, median tool call +12% (the 71-75% of the compression's CPU outside the
    loops then runs above the guests). Hence off by default."""
    if run_loops_below is None or not run_loops_below(COMPRESS_NICE, thread_nice()):
        set_thread_nice(COMPRESS_NICE)


def set_nice_of(tid: int, nice: int) -> bool:
    """Set thread ``tid``'s nice value (a thread of this process: the canceller of an
    operation raises the thread running it). False (and logged) where the kernel refuses."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except OSError as exc:
        log.debug("cannot set thread %d's nice value to %d: %s", tid, nice, exc)
        return False


def threads_named(pid: int, comm: str, *, prefix: bool = False) -> list[int]:
    """Thread ids of process ``pid`` named ``comm`` (or, ``prefix``, whose name starts with
    it), ascending; [] if the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue             # the thread ended meanwhile
        if name.startswith(comm) if prefix else name == comm:
            out.append(int(tid))
    return sorted(out)


def set_nice_of_named(pid: int, comm: str, nice: int) -> int:
    """Set the nice value of process ``pid``'s threads named ``comm`` (another process's:
    QEMU's export thread, which a paused guest waits for). Returns how many were set."""
    return sum(set_nice_of(tid, nice) for tid in threads_named(pid, comm))


@contextmanager
def nice_restored() -> Iterator[None]:
    """Give the calling thread its nice value back on the way out, whatever changed it
    meanwhile (``set_nice_of`` from a canceller, or ``at_nice``)."""
    before = thread_nice()
    try:
        yield
    finally:
        if thread_nice() != before:
            set_thread_nice(before)


@contextmanager
def at_nice(nice: int) -> Iterator[None]:
    """Run the block at ``nice``, then at the thread's own value again."""
    with nice_restored():
        if thread_nice() != nice:
            set_thread_nice(nice)
        yield


def run_at_nice(nice: int, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` (in a helper thread) at the priority of the thread that asked: a helper
    created by a niced compression thread must not slow a resume, nor the reverse."""
    if thread_nice() != nice:
        set_thread_nice(nice)
    return fn(*args)


# The kernel keeps 15 bytes of a thread's name (TASK_COMM_LEN less its NUL).
OS_NAME_BYTES = 15


def name_os_thread(name: str | None = None) -> bool:
    """Give the calling thread ``name`` (by default its Python name; cut to OS_NAME_BYTES) as
    its OS name: CPython before 3.14 leaves every thread named after the process. False where
    /proc refuses."""
    name = threading.current_thread().name if name is None else name
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name.encode()[:OS_NAME_BYTES].decode(errors="ignore"))
        return True
    except OSError as exc:
        log.debug("cannot name this thread %r: %s", name, exc)
        return False


def os_named(target: Callable[..., T]) -> Callable[..., T]:
    """``target``, run under its Python thread's name as its OS name (a threading.Thread's
    target, or a ThreadPoolExecutor's initializer)."""
    @functools.wraps(target)
    def run(*args: Any, **kwargs: Any) -> T:
        name_os_thread()
        return target(*args, **kwargs)
    return run
