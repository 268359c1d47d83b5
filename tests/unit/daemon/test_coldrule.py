"""The trim's coldness rule follows what the dropped pages did."""

from __future__ import annotations

import time
from functools import partial
from types import SimpleNamespace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from azqemu.daemon import coldrule
from azqemu.daemon.coldrule import ColdRule
from azqemu.daemon.sandboxmem import SandboxMemory


def test_pages_that_come_back_make_the_rule_wait_longer() -> None:
    r = ColdRule()
    r.note_dropped(np.arange(1000))
    assert r.judge(np.arange(500)) == 2 * coldrule.AFTER_MIN_S      # half came back
    r.note_dropped(np.arange(1000, 2000))
    assert r.judge(np.arange(1000, 1400)) == 4 * coldrule.AFTER_MIN_S
    r.note_dropped(np.arange(2000, 3000))
    assert r.judge(np.arange(2000, 2100)) == 4 * coldrule.AFTER_MIN_S  # 10%: holds
    r.note_dropped(np.arange(3000, 4000))
    assert r.judge(np.arange(3000, 3010)) == 2 * coldrule.AFTER_MIN_S  # 1%: shorter again
    assert r.judged == 4 and r.last_refault == 0.01


def test_too_few_drops_are_not_judged_and_a_compression_forgets_them() -> None:
    r = ColdRule()
    r.note_dropped(np.arange(coldrule.JUDGE_PAGES - 1))
    assert r.judge(np.arange(coldrule.JUDGE_PAGES)) == coldrule.AFTER_MIN_S and r.judged == 0
    r.forget_drops()
    r.note_dropped(np.arange(10))
    assert r.judge(np.arange(10)) == coldrule.AFTER_MIN_S and r.judged == 0


@given(st.lists(st.floats(0, 1), max_size=40))
def test_the_rule_stays_within_its_bounds(shares: list[float]) -> None:
    r = ColdRule()
    for share in shares:
        r.note_dropped(np.arange(1000))
        r.judge(np.arange(int(share * 1000)))
        assert coldrule.AFTER_MIN_S <= r.after_s <= coldrule.AFTER_MAX_S


def test_trims_that_drop_little_space_out_the_next_ones() -> None:
    """Each trim that drops under PAYOFF_SHARE of the copies doubles the least wait before
    the next (from twice the shortest cold age, up to BACKOFF_MAX_S); one that pays brings it
    back to nothing. A compression (forget_drops) keeps it: the next tool call's trims start
    at the pace the last ones had."""
    r = ColdRule()
    waits = []
    for k in range(6):
        r.note_dropped(np.arange(100) + 100 * k, 10_000)     # 1%: did not pay
        waits.append(r.pace_s)
    assert waits == [4.0, 8.0, 16.0, 32.0, 32.0, 32.0] and waits[-1] == coldrule.BACKOFF_MAX_S
    assert r.trim_gap_s() == coldrule.BACKOFF_MAX_S
    assert r.trim_gap_s(backoff=False) == r.after_s / 2
    r.note_dropped(np.arange(2_000), 10_000)                  # 20%: paid
    assert r.pace_s == 0.0 and r.trim_gap_s() == r.after_s / 2
    r.note_dropped(np.empty(0), 10_000)
    r.note_dropped(np.arange(50), 10_000)
    assert r.pace_s == 8.0
    r.forget_drops()
    assert r.pace_s == 8.0 and r.trim_gap_s() == 8.0 and r.state_bytes() == 0
    r.note_dropped(np.arange(300), 10_000)                    # 3%: paid
    r.note_dropped(np.empty(0), 0)                            # nothing resident: nothing to judge
    assert r.pace_s == 0.0


def test_dropped_pages_put_back_before_a_call_count_as_come_back() -> None:
    """A running sandbox's refill brings dropped pages back without a fault: the judge sees
    them as come back all the same (else trims would drop them again and again)."""
    rule = ColdRule()
    dropped = np.arange(2 * coldrule.JUDGE_PAGES)
    rule.note_dropped(dropped)
    rule.note_back(dropped[: coldrule.JUDGE_PAGES])          # half of them, no fault at all
    assert rule.judge(np.empty(0, dtype=np.int64)) == 2 * coldrule.AFTER_MIN_S
    assert rule.state_bytes() == 0                   # the window starts again


def test_drops_no_fault_can_judge_pay_for_the_pace_but_are_not_judged() -> None:
    r = ColdRule()
    r.note_dropped(np.arange(10), 10_000, paid=1000)       # 990 zero drops: the trim paid
    assert r.pace_s == 0.0
    r.note_dropped(np.arange(10, 20), 10_000)              # 0.1%: did not
    assert r.pace_s == 2 * coldrule.AFTER_MIN_S
    assert r.judge(np.arange(5)) == coldrule.AFTER_MIN_S and r.judged == 0   # 20 pages: too few


def test_a_tool_calls_first_trim_waits_for_the_pace_from_the_resume() -> None:
    """SandboxMemory.trim_due: the least time between trims counts from the last trim or
    the resume since, whichever came later, so a pace carried over a compression delays the
    next tool call's first trim by that much."""
    now = time.monotonic()
    mem = SimpleNamespace(cow=True, compressed=False, cold=ColdRule(), _trimmed_at=now - 60.0, _resumed_at=now - 3.0)
    due = partial(SandboxMemory.trim_due, mem, 2.0)  # type: ignore[arg-type]
    assert due()                                     # no pace: 2 s after the resume
    mem.cold.pace_s = 8.0                            # the last call's trims dropped little
    assert not due() and due(backoff=False)
    mem._resumed_at = now - 9.0
    assert due()
    mem._trimmed_at = now - 1.0                      # a trim since the resume
    assert not due(backoff=False)
    mem.compressed = True
    mem._trimmed_at = now - 60.0
    assert not due()                                 # compressed: nothing resident to trim
