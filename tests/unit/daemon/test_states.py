"""The sandbox state machine alone: the table is the one check, ``failed`` is sticky and
carries its reason, and slots hold up under threads that move and fail them at once."""

from __future__ import annotations

import itertools
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.daemon.states import (
    PAUSED_BY_AZQ,
    TRANSIENT,
    TRANSITIONS,
    Slot,
    SlotTable,
    State,
    parse_state,
    valid_transition,
)
from azqemu.errors import SandboxNotFound, SandboxStateError

ALL = list(State)


def test_table_covers_every_state_and_only_destroy_leaves_failed() -> None:
    assert set(TRANSITIONS) == set(State)
    assert TRANSITIONS[State.FAILED] == {State.DESTROYING}
    assert TRANSITIONS[State.DESTROYING] == {State.FAILED}
    for s in State:
        if s is not State.DESTROYING:
            assert valid_transition(s, State.FAILED) or s is State.FAILED
    assert PAUSED_BY_AZQ <= set(State) and TRANSIENT <= set(State)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(ALL, ALL)))
def test_every_pair_is_allowed_exactly_when_the_table_says(old: State, new: State) -> None:
    slot = Slot("s", old, "why" if old is State.FAILED else None)
    if new in TRANSITIONS[old]:
        slot.to(new, "because" if new is State.FAILED else None)
        assert slot.state is new
        assert slot.reason == ("because" if new is State.FAILED else None)
    else:
        with pytest.raises(SandboxStateError) as err:
            slot.to(new)
        assert (err.value.name, err.value.state, err.value.operation) == ("s", old.value, f"become {new.value}")
        assert slot.state is old


def test_failed_is_sticky_keeps_the_first_reason_and_is_persisted() -> None:
    seen: list[tuple[str, State, str | None]] = []
    slot = Slot("x", State.RUNNING, on_change=lambda n, s, r: seen.append((n, s, r)))
    slot.to(State.COMPRESSING)
    assert slot.fail("page 7 cannot be served")
    assert not slot.fail("a second reason")
    with pytest.raises(SandboxStateError) as err:
        slot.to(State.COMPRESSED)          # the compression that was under way
    assert err.value.reason == "page 7 cannot be served"
    assert "cannot become compressed (page 7 cannot be served)" in str(err.value)
    slot.to(State.DESTROYING)
    assert not slot.fail("late")           # a destroy under way is not failed again
    assert seen == [("x", State.COMPRESSING, None), ("x", State.FAILED, "page 7 cannot be served"),
                    ("x", State.DESTROYING, None)]


def test_require_names_the_state_the_operation_and_the_reason() -> None:
    slot = Slot("y", State.FAILED, "handler died 4 times")
    with pytest.raises(SandboxStateError) as err:
        slot.require("exec", (State.RUNNING, State.COMPRESSED))
    assert (err.value.state, err.value.operation, err.value.reason) == ("failed", "exec", "handler died 4 times")
    slot.retire()
    with pytest.raises(SandboxNotFound):
        slot.require("exec", (State.FAILED,))


def test_reasons_are_bounded_and_states_parse_back() -> None:
    slot = Slot("z", State.RUNNING)
    slot.fail("x" * 10_000)
    assert slot.reason is not None and len(slot.reason) == 500
    assert parse_state("compressed") is State.COMPRESSED
    assert parse_state("nonsense") is State.RUNNING and parse_state(None, State.FAILED) is State.FAILED


def test_table_refuses_a_second_live_slot_and_replaces_a_retired_one() -> None:
    table = SlotTable()
    first = table.add("a")
    with pytest.raises(SandboxStateError):
        table.add("a")
    table.remove("a")
    assert first.retired and table.get("a") is None
    second = table.add("a", State.RUNNING)
    table.remove("a", first)                 # an old slot's owner removes nothing of the new one
    assert table.get("a") is second and not second.retired
    third = table.add("a", State.COMPRESSED, replace=True)
    assert second.retired and table.get("a") is third


# -- under threads ------------------------------------------------------------------------
MOVES = st.sampled_from(["compress", "resume", "destroy", "fail"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(MOVES, min_size=1, max_size=8), min_size=2, max_size=6))
def test_threads_moving_one_slot_only_ever_make_table_transitions(plans: list[list[str]]) -> None:
    """Threads run operations on one slot the way lifecycle.py does (lock, require, to):
    every change any of them makes is an edge of the table, the slot never ends in a
    transient state, and a destroyed slot stays destroyed."""
    changes: list[tuple[State, State]] = []
    changes_mu = threading.Lock()
    prev = {"state": State.RUNNING}

    def on_change(_n: str, new: State, _r: str | None) -> None:
        with changes_mu:
            changes.append((prev["state"], new))
            prev["state"] = new

    table = SlotTable(on_change=on_change)
    slot = table.add("s", State.RUNNING)
    barrier = threading.Barrier(len(plans))
    outcomes: list[str] = []

    def run(plan: list[str]) -> None:
        barrier.wait()
        for move in plan:
            try:
                if move == "fail":
                    slot.fail("injected")
                    outcomes.append("failed")
                    continue
                if move == "destroy":
                    slot.request_destroy()
                with slot.lock:
                    if slot.retired:
                        raise SandboxNotFound("s")
                    if move == "compress":
                        before = slot.require("compress", (State.RUNNING, State.COMPRESSED))
                        slot.to(State.COMPRESSING)
                        slot.to(State.COMPRESSED if before is State.RUNNING else before)
                    elif move == "resume":
                        slot.require("resume", (State.COMPRESSED,))
                        slot.to(State.RESUMING)
                        slot.to(State.RUNNING)
                    else:
                        slot.to(State.DESTROYING)
                        table.remove("s", slot)
                outcomes.append(move)
            except (SandboxStateError, SandboxNotFound) as exc:
                outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=run, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(outcomes) == sum(len(p) for p in plans)       # one outcome per operation
    for old, new in changes:
        assert valid_transition(old, new), (old, new)
    assert slot.state not in TRANSIENT - {State.DESTROYING}
    if "destroy" in outcomes:
        assert slot.retired and slot.state is State.DESTROYING and table.get("s") is None
