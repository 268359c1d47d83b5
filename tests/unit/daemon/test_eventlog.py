"""The daemon's event log and who publishes into it: the buffer is bounded and ordered, filters
apply, followers are woken (threads and event loops), and the services publish created,
phase, compress, resume, failed and destroyed with their fields (fake host; the real thing
is in tests/integration/test_events.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from azqemu.daemon.accounting import Accounting
from azqemu.daemon.eventlog import LIBVIRT, MAX_TEXT_CHARS, EventLog
from azqemu.daemon.lifecycle import Lifecycle
from azqemu.daemon.manager import Manager
from azqemu.daemon.memstats import CompressStats, ResumeStats
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.daemon.schedsvc import SchedService
from azqemu.daemon.states import State
from azqemu.daemon.watch import DomainWatcher
from azqemu.errors import StoreFull
from azqemu.pages import PAGE_SIZE
from azqemu.sched import policy as policy_mod
from azqemu.sched.actions import SchedState
from azqemu.sched.agent_channel import AgentMessage
from azqemu.virt.clones import SandboxRecord
from azqemu.virt.templates import TemplateMeta
from tests.unit.daemon.test_lifecycle import FakeClone


def _kinds(log: EventLog, **kw: Any) -> list[tuple[str, str, str]]:
    return [(e["sandbox"], e["event"], e["detail"]) for e in log.events(**kw)]


# -- the log itself ------------------------------------------------------------------------
def test_events_are_ordered_bounded_and_carry_only_the_fields_given() -> None:
    now = [100.0]
    log = EventLog(maxlen=3, clock=lambda: now[0])
    e = log.publish("a", "compress", "done", stored_bytes=4096, reason=None)
    assert e == {"time": 100.0, "seq": 1, "sandbox": "a", "event": "compress", "detail": "done",
                 "source": "azqemu", "stored_bytes": 4096}
    now[0] = 99.0   # the clock stepped back: seq still orders
    log.publish("a", "resumed", "unpaused", source=LIBVIRT)
    log.publish("b", "failed", "x" * (MAX_TEXT_CHARS + 10), reason="y" * (MAX_TEXT_CHARS + 10))
    log.publish("b", "destroyed", "by azqemu")
    got = log.events()
    assert [e["seq"] for e in got] == [2, 3, 4] and log.last_seq == 4      # the oldest went
    assert len(got[1]["detail"]) == MAX_TEXT_CHARS and len(got[1]["reason"]) == MAX_TEXT_CHARS
    assert got[0]["source"] == "libvirt"
    got[0]["detail"] = "changed"                                           # a copy
    assert log.events()[0]["detail"] == "unpaused"


def test_filters_by_time_seq_sandbox_and_kind() -> None:
    now = [10.0]
    log = EventLog(clock=lambda: now[0])
    for sandbox, kind in (("a", "created"), ("b", "created"), ("a", "phase"), ("a", "destroyed")):
        log.publish(sandbox, kind)
        now[0] += 1
    assert [e["seq"] for e in log.events(since=11.0)] == [3, 4]
    assert [e["seq"] for e in log.events(after_seq=2)] == [3, 4]
    assert [e["event"] for e in log.events(sandbox="a")] == ["created", "phase", "destroyed"]
    assert [e["sandbox"] for e in log.events(kinds=["created"])] == ["a", "b"]
    assert [e["seq"] for e in log.events(sandbox="a", kinds={"destroyed", "created"})] == [1, 4]
    assert len(log.events(kinds=[])) == 4            # no kinds given: all
    assert log.events(sandbox="c") == []


def test_a_waiting_thread_is_woken_by_the_next_event() -> None:
    log = EventLog()
    assert not log.wait(0, timeout_s=0.05)
    woke: list[bool] = []
    t = threading.Thread(target=lambda: woke.append(log.wait(0, timeout_s=10)))
    t.start()
    time.sleep(0.05)
    log.publish("a", "created")
    t.join(5)
    assert woke == [True]
    assert log.wait(0, timeout_s=0)      # already there: no wait


def test_a_follower_in_an_event_loop_is_woken_from_another_thread() -> None:
    log = EventLog()

    async def follow() -> tuple[bool, float, bool]:
        t0 = time.monotonic()
        threading.Timer(0.1, log.publish, args=("a", "compress", "done")).start()
        woken = await log.wait_async(0, timeout_s=10)
        took = time.monotonic() - t0
        timed_out = await log.wait_async(log.last_seq, timeout_s=0.05)
        return woken, took, timed_out

    woken, took, timed_out = asyncio.run(follow())
    assert woken and took < 5 and not timed_out
    assert not log._async_waiters        # every waiter took itself out


# -- who publishes -------------------------------------------------------------------------
def test_a_slot_that_fails_is_published_once_with_its_state_before(registry: Registry) -> None:
    log = EventLog()
    registry.slots.on_failed = lambda n, was, reason: log.publish(n, "failed", reason, reason=reason,
                                                                 state=was.value)
    slot = registry.slots.add("a", State.CREATING)
    slot.to(State.RUNNING)
    assert registry.slots.get("a") is slot and slot.fail("a page cannot be served")
    assert not slot.fail("again")                    # the first reason is kept: no second event
    (e,) = log.events()
    assert (e["event"], e["reason"], e["state"]) == ("failed", "a page cannot be served", "running")
    b = registry.slots.add("b", State.CREATING)
    b.to(State.RUNNING)
    b.to(State.DESTROYING)
    b.to(State.FAILED, "destroy failed: VirtError: no")   # a destroy that failed
    assert [(e["sandbox"], e["state"]) for e in log.events()] == [("a", "running"), ("b", "destroying")]


def test_lifecycle_publishes_created_and_destroyed(registry: Registry, memory: MemoryService, host: Any,
                                                   sandbox_meta_of: Any, template: TemplateMeta) -> None:
    log = EventLog()
    life = Lifecycle(registry, memory, clone_fn=FakeClone(host, sandbox_meta_of), publish=log.publish)
    life.clone_batch("base", count=2, policy="none-cow")
    life.destroy("base-1")
    got = _kinds(log)
    assert sorted(got[:2]) == [("base-0", "created", "cow clone of base"), ("base-1", "created", "cow clone of base")]
    assert got[2:] == [("base-1", "destroyed", "by azqemu (was running)")]   # clones start in parallel
    created = log.events(kinds=["created"])[0]
    assert created["template"] == "base" and created["ram_mode"] == "cow" and created["policy"] == "none-cow"
    assert created["duration_s"] >= 0
    assert log.events(kinds=["destroyed"])[0]["state"] == "running"


def _sched(registry: Registry, memory: MemoryService, host: Any, sandbox_meta_of: Any,
           log: EventLog) -> SchedService:
    host.add("s0", sandbox_meta_of(), pid=4242)
    registry.sandboxes.save(SandboxRecord("s0", "base", "default", "eager", "u", 0.0, policy="agentzip"))
    registry.sched["s0"] = SchedState(policy_mod.get("agentzip"))
    return SchedService(registry, Lifecycle(registry, memory), Accounting(registry, memory), publish=log.publish)


def test_phase_changes_are_published_with_the_signal_that_decided_them(
        registry: Registry, memory: MemoryService, host: Any, sandbox_meta_of: Any) -> None:
    log = EventLog()
    svc = _sched(registry, memory, host, sandbox_meta_of, log)
    st = registry.sched["s0"]
    _ = svc.sched_states                             # the scheduler's tick: phase unknown, nothing
    assert log.events() == []
    svc.phase("s0", "wait")
    svc.phase("s0", "wait")                          # the same hint again: no new event
    _ = svc.sched_states
    st.tracker.exec_started()                        # a tool call azqemu runs: seen at the next tick
    _ = svc.sched_states
    st.tracker.exec_ended()
    _ = svc.sched_states
    got = [(e["phase"], e["signal"]) for e in log.events(kinds=["phase"])]
    assert got == [("wait", "hint"), ("tool", "exec"), ("wait", "exec")]
    assert log.events()[0]["detail"] == "wait (hint)"
    registry.sched.pop("s0")
    _ = svc.sched_states
    assert svc._published_phase == {}                # a sandbox gone is forgotten


def test_an_agent_report_is_published_when_it_decides_the_phase(
        registry: Registry, memory: MemoryService, host: Any, sandbox_meta_of: Any) -> None:
    log = EventLog()
    svc = _sched(registry, memory, host, sandbox_meta_of, log)
    svc.on_agent_message("s0", AgentMessage(sandbox="s0", event="busy", phase="tool", seq=1, guest_t_s=0.0,
                                            received_s=0.0))
    assert [(e["phase"], e["signal"]) for e in log.events()] == [("tool", "agent")]


class _FakeMem:
    """What MemoryService.compress/prefetch use of a SandboxMemory."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.owner = "u"
        self.compressed = True
        self.cow = False
        self.template = SimpleNamespace(drop_mapped=lambda: None)
        self.fail = fail

    def compress(self, stop: Any = None) -> CompressStats:
        if self.fail is not None:
            raise self.fail
        return CompressStats(resident_pages=100, stored_pages=60, total_s=0.25)

    def prefetch(self, *, hot: bool, call: int | None = None, part: str = "all") -> ResumeStats:
        if self.fail is not None:
            raise self.fail
        st = ResumeStats()
        st.prefetched_pages = 10
        return st

    def stored_bytes(self) -> int:
        return 12345

    def resident_bytes(self) -> int:
        return 0


def test_memory_publishes_compress_and_resume_and_their_failures(memory: MemoryService) -> None:
    log = EventLog()
    memory.publish = log.publish
    rec = SandboxRecord("m", "base", "default", "lazy", "u", 0.0)
    memory.mem["m"] = _FakeMem()  # type: ignore[assignment]
    assert memory.compress(rec)["stored_bytes"] == 12345
    memory.prefetch("m", hot=True)
    memory.mem["m"] = _FakeMem(fail=StoreFull("/dev/shm/store", "an arena"))  # type: ignore[assignment]
    with pytest.raises(StoreFull):
        memory.compress(rec)
    with pytest.raises(StoreFull):
        memory.prefetch("m", hot=True)
    done, resumed, c_failed, r_failed = log.events()
    assert (done["event"], done["detail"], done["stored_bytes"], done["stored_pages"], done["resident_pages"],
            done["duration_s"]) == ("compress", "done", 12345, 60, 100, 0.25)
    assert (resumed["event"], resumed["detail"], resumed["prefetched_pages"], resumed["prefetched_bytes"],
            resumed["left_pages"]) == ("resume", "done", 10, 10 * PAGE_SIZE, 0)
    assert (c_failed["event"], c_failed["detail"]) == ("compress", "failed")
    assert c_failed["reason"].startswith("StoreFull: ") and "duration_s" in c_failed
    assert (r_failed["event"], r_failed["detail"]) == ("resume", "failed")


def test_the_manager_wires_one_log_for_every_source(cfg: Any, host: Any, sandbox_meta_of: Any) -> None:
    host.add("a-0", sandbox_meta_of())
    m = Manager(cfg, host=host)
    assert m.watcher.eventlog is m.events
    m.watcher.on_event("a-0", "suspended", "paused")          # libvirt's, through the watcher
    assert m.registry.fail("a-0", "its stored pages are lost")
    m.lifecycle.destroy("a-0")
    assert [(e["event"], e["source"]) for e in m.op_events()] == [
        ("suspended", "libvirt"), ("failed", "azqemu"), ("destroyed", "azqemu")]
    (failed,) = m.op_events(sandbox="a-0", event=["failed"])
    assert failed["reason"] == "its stored pages are lost" and failed["state"] == "running"
    assert m.op_events(sandbox="other") == []


def test_the_watcher_marks_libvirt_events(registry: Registry, memory: MemoryService, host: Any,
                                          sandbox_meta_of: Any) -> None:
    log = EventLog()
    dom = host.add("w", sandbox_meta_of())
    registry.sandboxes.save(SandboxRecord("w", "base", "default", "eager", dom.uuid, 0.0))
    w = DomainWatcher(registry, memory, eventlog=log)
    w.on_event("w", "stopped", "destroyed")
    dom.destroy()
    assert w.handle_ending("w", "stopped", "destroyed")
    assert [(e["event"], e["source"]) for e in log.events()] == [("stopped", "libvirt"), ("released", "azqemu")]
