"""The scheduler: acts on phases, per sandbox, as its policy says (runs in the daemon).

Every tick it looks at each sandbox's phase (``phases.PhaseTracker``) and policy
(``policy.Policy``): a sandbox of a compressing policy that has waited for its LLM longer
than the grace period is compressed (in a single worker, so two compressions never fight
for the two cores of a small host); a ``linux`` sandbox gets its RAM paged out to zram
once per wait; a compressing sandbox whose tool call runs long is trimmed (what it holds
unchanged since its last compression is dropped again) every ``policy.TRIM_EVERY_S``, when
the worker has nothing else to do (compressions first); the
``agentzip-pressure`` ablation ignores phases and compresses the largest
sandboxes while their memory is over a budget. A tool call never waits for a compression:
``azq exec`` cancels a running one and resumes the sandbox first (the daemon does that).
What the scheduler does to a sandbox goes through ``actions.SchedActions``: it knows
nothing of the daemon.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import psutil

from azqemu.host.threads import background_worker, os_named
from azqemu.sched.actions import SchedActions, SchedState
from azqemu.sched.phases import TOOL, WAIT
from azqemu.sched.policy import TRIM_AFTER_S, TRIM_EVERY_S

log = logging.getLogger(__name__)

TICK_S = 0.1
HOST_SAMPLE_S = 1.0


class Scheduler:
    def __init__(self, actions: SchedActions, tick_s: float = TICK_S,
                 clock: Callable[[], float] = time.monotonic,
                 run_loops_below: Callable[[int, int], bool] | None = None) -> None:
        self.actions = actions
        self.tick_s = tick_s
        self._clock = clock  # the phase trackers' clock (time.monotonic but in tests)
        self.pressure_budget_bytes: int | None = None
        # Compression is background work: its worker runs below the vCPUs, or only its C loops
        # do (``run_loops_below``: the codec's, memory/zstdlib.py; host.threads.background_worker).
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="azq-compress",
                                          initializer=os_named(functools.partial(background_worker,
                                                                                 run_loops_below)))
        self._queued = 0                  # jobs submitted and not finished (the worker's queue)
        self._queued_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=os_named(self._run), name="azq-scheduler", daemon=True)
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
        now = self._clock()
        sample_host = now - self._last_host_sample >= HOST_SAMPLE_S
        if sample_host:
            self._last_host_sample = now
        for name, st in list(self.actions.sched_states.items()):
            if sample_host:
                self._sample_cpu(name, st, now)
            ph = st.tracker.current()
            # A trim goes to an idle worker only, so a compression waits for one running trim
            # at most: queued behind every sandbox's trims it found its wait over (8 sandboxes
            # of long-lived-heap: 36 waits compressed of ~128; 48 with this rule).
            if (st.policy.trim_in_tool and ph.phase == TOOL and now - ph.since_s >= TRIM_AFTER_S
                    and now - st.trimmed_at_s >= TRIM_EVERY_S and not self._busy(st)):
                if self._queued == 0:
                    st.trimmed_at_s = now
                    st.pending = self._submit(st, f"trimming {name}", self.actions.trim_if_running, name)
                continue
            waited = ph.phase == WAIT and now - ph.since_s >= st.grace_s
            if not waited or st.acted_on_wait_s == ph.since_s or self._busy(st):
                continue
            if st.policy.compress_on_wait:
                st.acted_on_wait_s = ph.since_s
                st.pending = self._submit(st, f"compressing {name}", self._compress_same_wait, name, st, ph.since_s)
            elif st.policy.linux_reclaim:
                st.acted_on_wait_s = ph.since_s
                st.pending = self._submit(st, f"paging out {name}", self.actions.pageout, name)
        if self.pressure_budget_bytes is not None:
            self._pressure()

    def _sample_cpu(self, name: str, st: SchedState, now: float) -> None:
        pid = self.actions.qemu_pid(name)
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
    def _busy(st: SchedState) -> bool:
        """Work for this sandbox is queued or running. A done future counts as none: a short
        job can finish before ``submit`` returns and its future is stored over the ``None``
        the job left (the worker's first job runs while its thread starts), and the sandbox
        would then never be acted on again."""
        return st.pending is not None and not st.pending.done()

    def _submit(self, st: SchedState, what: str, fn: Callable[..., object], *args: object) -> Future[object]:
        with self._queued_lock:
            self._queued += 1
        try:
            return self._worker.submit(self._job, st, what, fn, *args)
        except BaseException:
            with self._queued_lock:
                self._queued -= 1
            raise

    def _job(self, st: SchedState, what: str, fn: Callable[..., object], *args: object) -> None:
        """Run one piece of background work; a failure is logged, the sandbox stays as it is."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the worker must outlive one failure
            log.warning("%s failed: %s", what, exc)
        finally:
            st.pending = None
            with self._queued_lock:
                self._queued -= 1

    def _compress_same_wait(self, name: str, st: SchedState, wait_since_s: float) -> None:
        """Compress only if the wait that was seen is still the current one."""
        ph = st.tracker.current()
        if ph.phase == WAIT and ph.since_s == wait_since_s:
            self.actions.compress_if_idle(name, st)

    def _pressure(self) -> None:
        """agentzip-pressure: over budget, compress the largest sandbox, phases ignored."""
        budget = self.pressure_budget_bytes or 0
        cands = [(name, st) for name, st in list(self.actions.sched_states.items()) if st.policy.pressure]
        if not cands:
            return
        sizes = {name: self.actions.resident_bytes(name) or 0 for name, _ in cands}
        if sum(sizes.values()) <= budget:
            return
        for name, st in sorted(cands, key=lambda c: -sizes[c[0]]):
            if not self._busy(st) and sizes[name] > 0:
                st.pending = self._submit(st, f"pressure compression of {name}", self.actions.compress_and_run_on, name)
                return
