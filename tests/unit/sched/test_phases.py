"""Phase detection: hints and azqemu's own exec calls form one stream (newest wins); the
in-guest agent and host signals count only where that stream is silent."""

from __future__ import annotations

import pytest

from azqemu.sched.phases import IDLE_CPU_FRACTION, TOOL, UNKNOWN, WAIT, PhaseTracker


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def tr(clock: Clock) -> PhaseTracker:
    return PhaseTracker(clock=clock)


def test_nothing_known_is_unknown(tr: PhaseTracker) -> None:
    ph = tr.current()
    assert (ph.phase, ph.source) == (UNKNOWN, "none")
    assert not tr.in_tool_call()


def test_a_repeated_hint_does_not_restart_the_wait(tr: PhaseTracker, clock: Clock) -> None:
    tr.hint(WAIT)
    clock.t = 105.0
    tr.hint(WAIT)
    assert tr.current().since_s == 100.0
    tr.hint(TOOL)
    assert (tr.current().phase, tr.current().since_s) == (TOOL, 105.0)


def test_an_unknown_hint_is_refused(tr: PhaseTracker) -> None:
    with pytest.raises(ValueError, match="unknown phase 'lunch' \\(tool, wait\\)"):
        tr.hint("lunch")
    assert tr.current().phase == UNKNOWN


def test_exec_calls_are_a_tool_phase_and_the_last_end_starts_a_wait(tr: PhaseTracker, clock: Clock) -> None:
    tr.hint(WAIT)
    clock.t = 101.0
    tr.exec_started()
    clock.t = 102.0
    tr.exec_started()  # a second call in parallel: the tool phase began with the first
    ph = tr.current()
    assert (ph.phase, ph.since_s, ph.source) == (TOOL, 101.0, "exec")
    assert tr.in_tool_call()
    clock.t = 103.0
    tr.exec_ended()
    assert tr.current().phase == TOOL  # one still runs
    clock.t = 104.0
    tr.exec_ended()
    ph = tr.current()
    assert (ph.phase, ph.since_s, ph.source) == (WAIT, 104.0, "exec")
    assert not tr.in_tool_call()


def test_a_call_in_flight_wins_over_a_wait_hint(tr: PhaseTracker) -> None:
    tr.exec_started()
    tr.hint(WAIT)
    assert tr.current().phase == TOOL
    assert tr.in_tool_call()


def test_the_agent_counts_only_where_hints_and_execs_are_silent(tr: PhaseTracker) -> None:
    tr.host_sample(0.0)
    assert (tr.current().phase, tr.current().source) == (WAIT, "host")
    tr.agent_event(TOOL)
    assert (tr.current().phase, tr.current().source) == (TOOL, "agent")
    tr.hint(WAIT)
    assert (tr.current().phase, tr.current().source) == (WAIT, "hint")
    tr.agent_event(WAIT)
    tr.agent_event(TOOL)
    assert tr.current().source == "hint"


def test_host_samples_turn_into_phases_at_the_idle_threshold(tr: PhaseTracker, clock: Clock) -> None:
    tr.host_sample(IDLE_CPU_FRACTION / 2)
    assert tr.current().phase == WAIT
    clock.t = 110.0
    tr.host_sample(IDLE_CPU_FRACTION / 4)  # still idle: the wait keeps its start
    assert tr.current().since_s == 100.0
    tr.host_sample(IDLE_CPU_FRACTION)
    assert (tr.current().phase, tr.current().since_s) == (TOOL, 110.0)
