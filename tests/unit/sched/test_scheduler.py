"""The scheduler against a fake ``SchedActions``: one compression per LLM wait longer than
the grace period, none once a tool call came in between, one page-out per wait under the
linux policy, and the pressure ablation compressing the largest sandbox over the budget."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import pytest

from azqemu.sched import policy
from azqemu.sched.actions import SchedActions, SchedState
from azqemu.sched.phases import PhaseTracker
from azqemu.sched.scheduler import Scheduler


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeActions:
    """Records what the scheduler asks for. A compression can be held (``hold``) to see what
    the scheduler does while its single worker is busy."""

    def __init__(self) -> None:
        self.states: dict[str, SchedState] = {}
        self.calls: list[tuple[str, str]] = []
        self.sizes: dict[str, int] = {}
        self.hold: threading.Event | None = None
        self.started = threading.Event()

    @property
    def sched_states(self) -> Mapping[str, SchedState]:
        return self.states

    def compress_if_idle(self, name: str, st: SchedState) -> None:
        self.calls.append(("compress", name))
        self.started.set()
        if self.hold is not None:
            self.hold.wait(5)

    def compress_and_run_on(self, name: str) -> None:
        self.calls.append(("pressure", name))

    def pageout(self, name: str) -> None:
        self.calls.append(("pageout", name))

    def trim_if_running(self, name: str) -> None:
        self.calls.append(("trim", name))

    def qemu_pid(self, name: str) -> int | None:
        return None

    def resident_bytes(self, name: str) -> int | None:
        return self.sizes.get(name)


def _typed(actions: FakeActions) -> SchedActions:
    return actions  # the fake is a SchedActions (mypy checks this line when tests are checked)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fake() -> FakeActions:
    return FakeActions()


@pytest.fixture
def sched(fake: FakeActions, clock: Clock) -> Iterator[Scheduler]:
    # Started (so stop() can join it) but ticking only when a test calls tick().
    s = Scheduler(_typed(fake), tick_s=3600, clock=clock)
    s.start()
    yield s
    if fake.hold is not None:
        fake.hold.set()
    s.stop()


def _add(fake: FakeActions, clock: Clock, name: str, pol: str, grace_s: float = 1.0) -> SchedState:
    st = SchedState(policy.get(pol), grace_s=grace_s, tracker=PhaseTracker(clock=clock))
    fake.states[name] = st
    return st


def _tick(sched: Scheduler) -> None:
    """One tick, then wait until the work it queued is done (the worker is one thread)."""
    sched.tick()
    sched._worker.submit(lambda: None).result(timeout=5)


def test_a_wait_longer_than_the_grace_period_compresses_once(sched: Scheduler, fake: FakeActions,
                                                             clock: Clock) -> None:
    st = _add(fake, clock, "a", "agentzip", grace_s=1.0)
    st.tracker.hint("wait")
    clock.t += 0.5
    _tick(sched)
    assert fake.calls == []  # within the grace period
    clock.t += 0.6
    _tick(sched)
    assert fake.calls == [("compress", "a")]
    for _ in range(3):
        clock.t += 1.0
        _tick(sched)
    assert fake.calls == [("compress", "a")]  # once per wait
    st.tracker.exec_started()
    clock.t += 0.2
    st.tracker.exec_ended()  # the next wait begins
    clock.t += 1.5
    _tick(sched)
    assert fake.calls == [("compress", "a"), ("compress", "a")]


def test_a_tool_call_within_the_grace_period_cancels(sched: Scheduler, fake: FakeActions, clock: Clock) -> None:
    st = _add(fake, clock, "a", "agentzip", grace_s=1.0)
    st.tracker.hint("wait")
    clock.t += 0.8
    st.tracker.exec_started()
    clock.t += 5.0
    _tick(sched)  # waited long ago, but a tool call runs now
    st.tracker.exec_ended()
    clock.t += 0.5
    _tick(sched)  # the new wait is younger than the grace period
    assert [c for c in fake.calls if c[0] == "compress"] == []
    assert fake.calls == [("trim", "a")]   # the 5 s tool call was trimmed once, nothing else


def test_a_long_tool_call_is_trimmed_every_few_seconds_only_under_trimming_policies(
        sched: Scheduler, fake: FakeActions, clock: Clock) -> None:
    from azqemu.sched.policy import TRIM_AFTER_S, TRIM_EVERY_S

    az = _add(fake, clock, "az", "agentzip")
    nt = _add(fake, clock, "nt", "agentzip-no-trim")
    cow = _add(fake, clock, "cow", "none-cow")
    for st in (az, nt, cow):
        st.tracker.exec_started()
    clock.t += TRIM_AFTER_S - 0.5
    _tick(sched)
    assert fake.calls == []                          # too early in the tool call
    clock.t += 1.0
    _tick(sched)
    _tick(sched)
    assert fake.calls == [("trim", "az")]            # once, not at every tick
    clock.t += TRIM_EVERY_S
    _tick(sched)
    assert fake.calls == [("trim", "az")] * 2
    az.tracker.exec_ended()                          # a wait: no more trims, a compression
    clock.t += TRIM_EVERY_S
    _tick(sched)
    assert fake.calls == [("trim", "az")] * 2 + [("compress", "az")]


def test_a_tool_call_after_the_decision_cancels_the_queued_compression(sched: Scheduler, fake: FakeActions,
                                                                       clock: Clock) -> None:
    busy = _add(fake, clock, "busy", "agentzip")
    late = _add(fake, clock, "late", "agentzip")
    busy.tracker.hint("wait")
    late.tracker.hint("wait")
    fake.hold = threading.Event()
    clock.t += 2.0
    sched.tick()  # both queued; the single worker holds the first
    assert fake.started.wait(5)
    late.tracker.hint("tool")  # the LLM answered while the compression waited its turn
    fake.hold.set()
    sched._worker.submit(lambda: None).result(timeout=5)
    assert fake.calls == [("compress", "busy")]
    assert late.pending is None and busy.pending is None


def test_non_compressing_policies_leave_sandboxes_alone(sched: Scheduler, fake: FakeActions,
                                                        clock: Clock) -> None:
    for pol in ("manual", "none", "none-cow"):
        _add(fake, clock, pol, pol).tracker.hint("wait")
    clock.t += 10.0
    _tick(sched)
    assert fake.calls == []


def test_linux_pages_out_once_per_wait(sched: Scheduler, fake: FakeActions, clock: Clock) -> None:
    st = _add(fake, clock, "l", "linux", grace_s=1.0)
    st.tracker.hint("wait")
    clock.t += 1.5
    _tick(sched)
    clock.t += 1.0
    _tick(sched)
    assert fake.calls == [("pageout", "l")]
    st.tracker.hint("tool")
    clock.t += 1.0
    st.tracker.hint("wait")
    clock.t += 0.5
    _tick(sched)
    assert fake.calls == [("pageout", "l")]  # the new wait is within its grace period
    clock.t += 1.0
    _tick(sched)
    assert fake.calls == [("pageout", "l"), ("pageout", "l")]


def test_pressure_compresses_the_largest_sandbox_over_budget(sched: Scheduler, fake: FakeActions,
                                                             clock: Clock) -> None:
    for name, size in (("small", 100), ("large", 300), ("mid", 200)):
        _add(fake, clock, name, "agentzip-pressure").tracker.hint("tool")  # phases are ignored
        fake.sizes[name] = size
    _add(fake, clock, "other", "none-cow")
    fake.sizes["other"] = 10_000  # not under the pressure policy: neither counted nor chosen
    sched.pressure_budget_bytes = 600
    _tick(sched)
    assert fake.calls == []  # 600 bytes: at the budget, not over it
    sched.pressure_budget_bytes = 500
    _tick(sched)
    assert fake.calls == [("pressure", "large")]  # one per tick, the largest first
    fake.sizes["large"] = 0  # compressed: nothing resident left
    _tick(sched)
    assert fake.calls == [("pressure", "large")]  # 300 bytes left, under the budget
    sched.pressure_budget_bytes = 250
    _tick(sched)
    assert fake.calls == [("pressure", "large"), ("pressure", "mid")]


def test_pressure_skips_a_sandbox_whose_compression_is_still_queued(sched: Scheduler, fake: FakeActions,
                                                                    clock: Clock) -> None:
    for name, size in (("large", 300), ("mid", 200)):
        _add(fake, clock, name, "agentzip-pressure")
        fake.sizes[name] = size
    blocker = _add(fake, clock, "blocker", "agentzip")
    blocker.tracker.hint("wait")
    fake.hold = threading.Event()
    clock.t += 2.0
    sched.tick()  # the blocker's compression holds the single worker
    assert fake.started.wait(5)
    fake.states["large"].pending = sched._worker.submit(lambda: None)  # queued behind it
    sched.pressure_budget_bytes = 100
    sched.tick()
    assert fake.states["mid"].pending is not None
    fake.hold.set()
    sched._worker.submit(lambda: None).result(timeout=5)
    assert fake.calls == [("compress", "blocker"), ("pressure", "mid")]


def test_a_trim_never_queues_ahead_of_a_compression(sched: Scheduler, fake: FakeActions, clock: Clock) -> None:
    """Trims go to an idle worker only: with a compression running (or queued), a sandbox
    in a long tool call is not trimmed at that tick, and the compression of a second wait
    runs right after the first, not behind trims."""
    from azqemu.sched.policy import TRIM_AFTER_S

    w1, w2, tool = (_add(fake, clock, n, "agentzip") for n in ("w1", "w2", "tool"))
    tool.tracker.exec_started()
    w1.tracker.hint("wait")
    fake.hold = threading.Event()
    clock.t += TRIM_AFTER_S + 0.5
    sched.tick()                                  # w1's compression runs (held); no trim queued
    assert fake.started.wait(5)
    w2.tracker.hint("wait")
    clock.t += 1.5
    sched.tick()                                  # w2's compression queued; still no trim
    fake.hold.set()
    sched._worker.submit(lambda: None).result(timeout=5)
    assert fake.calls == [("compress", "w1"), ("compress", "w2")]
    _tick(sched)                                  # the worker is idle again: now the trim
    assert fake.calls[-1] == ("trim", "tool") and sched._queued == 0
