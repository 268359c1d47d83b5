"""The exit watch: the in-guest agent's tool starts and ends of guest-exec'd commands, which
exec waits on instead of polling qemu-ga (azqemu/sched/exitwatch.py)."""

from __future__ import annotations

import threading
import time

from azqemu.sched import exitwatch
from azqemu.sched.agent_channel import AgentMessage
from azqemu.sched.exitwatch import ExitWatch


def msg(event: str, pid: int, source: str = "guest-exec") -> AgentMessage:
    return AgentMessage(sandbox="s", event=event, phase="tool" if event == "tool-start" else "wait",
                        seq=1, guest_t_s=0.0, received_s=0.0, pid=pid, comm="sleep", source=source,
                        duration_s=0.1 if event == "tool-end" else None)


def test_a_command_the_agent_did_not_see_start_is_not_waited_for() -> None:
    w = ExitWatch()
    t0 = time.monotonic()
    assert w.wait_exit("s", 42, 5.0) is None and time.monotonic() - t0 < 0.5
    w.note("s", msg("tool-start", 42, source="hint"))       # azq-phase's, not a guest-exec's
    assert w.wait_exit("s", 42, 5.0) is None


def test_the_end_wakes_the_waiter_at_once() -> None:
    w = ExitWatch()
    w.note("s", msg("tool-start", 42))
    threading.Timer(0.05, w.note, ("s", msg("tool-end", 42))).start()
    t0 = time.monotonic()
    assert w.wait_exit("s", 42, 5.0) is True
    assert time.monotonic() - t0 < 1.0
    # Waited for once: the pid is forgotten (a later command may get it again).
    assert w.wait_exit("s", 42, 0.01) is None


def test_an_end_reported_before_the_wait_is_kept_and_other_sandboxes_are_apart() -> None:
    w = ExitWatch()
    w.note("s", msg("tool-start", 7))
    w.note("s", msg("tool-end", 7))
    w.note("other", msg("tool-start", 8))
    w.note("other", msg("tool-end", 8))
    assert w.wait_exit("s", 7, 0.0) is True
    assert w.wait_exit("s", 8, 0.01) is None          # sandbox s never started pid 8
    w.note("s", msg("tool-start", 9))
    assert w.wait_exit("s", 9, 0.05) is False          # no end: timed out


def test_a_guest_that_floods_reports_holds_a_bounded_book() -> None:
    w = ExitWatch()
    for pid in range(1, 10 * exitwatch.REMEMBERED_PIDS):
        w.note("s", msg("tool-start", pid))
        w.note("s", msg("tool-end", pid))
    assert len(w._started["s"]) == len(w._ended["s"]) == exitwatch.REMEMBERED_PIDS
    w.forget("s")
    assert "s" not in w._started and "s" not in w._ended
