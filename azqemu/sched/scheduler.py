"""The scheduler: acts on phases, per sandbox, as its policy says (runs in the daemon).

Every tick it looks at each sandbox's phase (``phases.PhaseTracker``) and policy
(``policy.Policy``): a sandbox of a compressing policy that has waited for its LLM longer
than the grace period is compressed (in a single worker, so two compressions never fight
for the two cores of a small host); a ``linux`` sandbox gets its RAM paged out to zram
once per wait; the ``agentzip-pressure`` ablation ignores phases and compresses the largest
sandboxes while their memory is over a budget. A tool call never waits for a compression:
``azq exec`` cancels a running one and resumes the sandbox first (the manager does that).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from azqemu.sched.phases import WAIT, PhaseTracker
from azqemu.sched.policy import DEFAULT_GRACE_S, Policy

if TYPE_CHECKING:
    from azqemu.daemon.manager import Manager

log = logging.getLogger(__name__)

TICK_S = 0.1
HOST_SAMPLE_S = 1.0
# Compression is background work: on a small host it must not take CPU from the vCPUs of
# sandboxes running tool calls (nor from the fault handlers, which stay at nice 0).
COMPRESS_NICE = 10


def _lower_priority() -> None:
    """setpriority(2) on a thread id lowers that thread only (Linux semantics)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPRESS_NICE)
    except OSError as exc:
        log.debug("cannot lower the compression thread's priority: %s", exc)


@dataclass
class SchedState:
    """What the scheduler knows of one sandbox."""

    policy: Policy
    grace_s: float = DEFAULT_GRACE_S
    tracker: PhaseTracker = field(default_factory=PhaseTracker)
    acted_on_wait_s: float = -1.0      # since_s of the wait already acted on
    pending: Future[object] | None = None
    cpu_prev: tuple[float, float] | None = None   # (monotonic, QEMU cpu seconds)


class Scheduler:
    def __init__(self, manager: Manager, tick_s: float = TICK_S) -> None:
        self.m = manager
        self.tick_s = tick_s
        self.pressure_budget_bytes: int | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="azq-compress",
                                          initializer=_lower_priority)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="azq-scheduler", daemon=True)
        self._last_host_sample = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._worker.shutdown(wait=True, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the scheduler must outlive one bad tick
                log.exception("scheduler tick failed")

    def tick(self) -> None:
        now = time.monotonic()
        sample_host = now - self._last_host_sample >= HOST_SAMPLE_S
        if sample_host:
            self._last_host_sample = now
        for name, st in list(self.m.sched.items()):
            if sample_host:
                self._sample_cpu(name, st, now)
            ph = st.tracker.current()
            waited = ph.phase == WAIT and now - ph.since_s >= st.grace_s
            if not waited or st.acted_on_wait_s == ph.since_s or st.pending is not None:
                continue
            if st.policy.compress_on_wait:
                st.acted_on_wait_s = ph.since_s
                st.pending = self._worker.submit(self._job, st, f"compressing {name}",
                                                 self._compress_same_wait, name, st, ph.since_s)
            elif st.policy.linux_reclaim:
                st.acted_on_wait_s = ph.since_s
                st.pending = self._worker.submit(self._job, st, f"paging out {name}", self.m.pageout, name)
        if self.pressure_budget_bytes is not None:
            self._pressure()

    def _sample_cpu(self, name: str, st: SchedState, now: float) -> None:
        pid = self.m.qemu_pid(name)
        if pid is None:
            return
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return
        cpu = t.user + t.system
        if st.cpu_prev is not None and now > st.cpu_prev[0]:
            st.tracker.host_sample((cpu - st.cpu_prev[1]) / (now - st.cpu_prev[0]))
        st.cpu_prev = (now, cpu)

    @staticmethod
    def _job(st: SchedState, what: str, fn: Callable[..., object], *args: object) -> None:
        """Run one piece of background work; a failure is logged, the sandbox stays as it is."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the worker must outlive one failure
            log.warning("%s failed: %s", what, exc)
        finally:
            st.pending = None

    def _compress_same_wait(self, name: str, st: SchedState, wait_since_s: float) -> None:
        """Compress only if the wait that was seen is still the current one."""
        ph = st.tracker.current()
        if ph.phase == WAIT and ph.since_s == wait_since_s:
            self.m.compress_if_idle(name, st)

    def _pressure(self) -> None:
        """agentzip-pressure: over budget, compress the largest sandbox, phases ignored."""
        budget = self.pressure_budget_bytes or 0
        cands = [(name, st) for name, st in self.m.sched.items() if st.policy.pressure]
        if not cands:
            return
        sizes = {name: self.m.resident_bytes(name) or 0 for name, _ in cands}
        if sum(sizes.values()) <= budget:
            return
        for name, st in sorted(cands, key=lambda c: -sizes[c[0]]):
            if st.pending is None and sizes[name] > 0:
                st.pending = self._worker.submit(self._job, st, f"pressure compression of {name}",
                                                 self.m.compress_and_run_on, name)
                return
