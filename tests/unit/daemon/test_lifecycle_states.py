"""The lifecycle service through its state machine, against a fake host and a memory service
whose compression takes steps and can be cancelled: compress, resume, exec and destroy on one
sandbox from many threads, in any order, each give one defined outcome; failures carry their
reason into ``azq list``; the fault supervisor fails a sandbox whose faults cannot be served."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from azqemu.agent import ExecResult
from azqemu.daemon import lifecycle as lifecycle_mod
from azqemu.daemon.accounting import Accounting
from azqemu.daemon.lifecycle import Lifecycle
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.daemon.sandboxmem import CompressCancelled
from azqemu.daemon.states import TRANSIENT, State, valid_transition
from azqemu.daemon.supervisor import MAX_FAULT_RETRIES, MAX_RESTARTS, FaultSupervisor
from azqemu.errors import (
    AgentError,
    DomainStateError,
    SandboxNotFound,
    SandboxStateError,
    StoreFull,
)
from azqemu.restore.errors import PageUnavailable
from azqemu.virt.clones import SandboxRecord, SandboxRepo
from azqemu.virt.templates import TemplateMeta

# What an operation may end with when others act on the same sandbox at once.
DEFINED_ERRORS = (SandboxNotFound, SandboxStateError, DomainStateError, CompressCancelled)


class SteppedMemory(MemoryService):
    """A memory service whose compression runs ``steps`` steps and stops at a cancel: its
    own flag, cleared as it starts (as SandboxMemory's), the destroy's for-good mark, and the
    real service's cancel tickets (MemoryService.cancel_ticket)."""

    def __init__(self, base: MemoryService, steps: int = 5, step_s: float = 0.001) -> None:
        super().__init__(base.cfg, base.templates, base.sandboxes, lazy_available=True)
        self.steps, self.step_s = steps, step_s
        self._cancel_events: dict[str, threading.Event] = {}
        self.compressed_names: set[str] = set()
        self.released: list[str] = []
        self.prefetch_error: BaseException | None = None
        self.compress_error: BaseException | None = None
        self.ending: set[str] = set()          # cancelled for good (a destroy), as SandboxMemory
        self.before_start: threading.Event | None = None   # a compression waits here first
        self.started = threading.Event()

    def _ev(self, name: str) -> threading.Event:
        return self._cancel_events.setdefault(name, threading.Event())

    def compress(self, rec: SandboxRecord, ticket: int | None = None) -> dict[str, Any]:
        if self.compress_error is not None:
            raise self.compress_error
        ev = self._ev(rec.name)
        stop = self.stop_test(rec.name, ticket)
        self.started.set()
        if self.before_start is not None:
            self.before_start.wait(5)
        ev.clear()
        for _ in range(self.steps):
            time.sleep(self.step_s)
            if ev.is_set() or rec.name in self.ending or (stop is not None and stop()):
                raise CompressCancelled(rec.name)
        self.compressed_names.add(rec.name)
        return {"name": rec.name, "stored_pages": 1, "cancelled": False}

    def cancel(self, name: str, *, for_good: bool = False) -> None:
        super().cancel(name, for_good=for_good)       # the ticket count
        if for_good:
            self.ending.add(name)
        self._ev(name).set()

    def prefetch(self, name: str, *, hot: bool, call: int | None = None, part: str = "all") -> dict[str, Any]:
        if self.prefetch_error is not None:
            raise self.prefetch_error
        self.compressed_names.discard(name)
        return {"prefetched_pages": 3, "prefetch_s": 0.0}

    def release(self, name: str) -> None:
        self.released.append(name)

    def has_stored(self, name: str) -> bool:
        return False


class FakeAgent:
    def __init__(self, name: str, _command: Any) -> None:
        self.name = name

    def exec(self, argv: list[str], timeout_s: float, stdin: bytes | None = None, on_output: Any = None,
             exit_wait: Any = None) -> ExecResult:
        time.sleep(0.002)
        return ExecResult(0, b"ok", b"", 0.002)


class RecordingRegistry(Registry):
    """Every state change any thread makes, in order (old, new)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.changes: list[tuple[str, State]] = []
        self._mu = threading.Lock()
        super().__init__(*args, **kw)

    def _persist_state(self, name: str, state: State, reason: str | None) -> None:
        with self._mu:
            self.changes.append((name, state))
        super()._persist_state(name, state, reason)


def _fake_clone(host: Any, meta_of: Any) -> Any:
    def clone(host_: Any, tmpl: TemplateMeta, name: str, *, sharing_domain: str, ram_mode: str, fill: Any,
              repo: SandboxRepo, env: Any, ram_backing: str, policy: str, grace_s: float,
              ksm_merge: bool = False) -> SandboxRecord:
        dom = host.add(name, meta_of(template=tmpl.name, ram_mode=ram_mode, sharing_domain=sharing_domain))
        rec = SandboxRecord(name=name, template=tmpl.name, sharing_domain=sharing_domain, ram_mode=ram_mode,
                            uuid=dom.uuid, created_at=0.0, policy=policy, grace_s=grace_s)
        repo.save(rec)
        return rec
    return clone


@pytest.fixture
def rreg(cfg: Any, host: Any, registry: Registry) -> RecordingRegistry:
    return RecordingRegistry(cfg, host, registry.templates, registry.sandboxes)


@pytest.fixture
def smem(memory: MemoryService) -> SteppedMemory:
    return SteppedMemory(memory)


@pytest.fixture
def life(rreg: RecordingRegistry, smem: SteppedMemory, host: Any, sandbox_meta_of: Any,
         template: TemplateMeta, monkeypatch: pytest.MonkeyPatch) -> Lifecycle:
    monkeypatch.setattr(lifecycle_mod, "GuestAgent", FakeAgent)
    return Lifecycle(rreg, smem, clone_fn=_fake_clone(host, sandbox_meta_of),
                     destroy_fn=lifecycle_mod.destroy)


def _check_consistent(life: Lifecycle, host: Any, name: str) -> None:
    """After every thread is done: no transient state, domain and books agree."""
    reg = life.reg
    slot = reg.slots.get(name)
    if slot is None:
        assert name not in host.doms and not reg.sandboxes.path(name).exists() and name not in reg.sched
        return
    assert slot.state not in TRANSIENT, slot.state
    assert reg.record(name).state == slot.state.value           # persisted with the record
    dom_state = host.doms[name].state()
    if slot.state is State.COMPRESSED:
        assert dom_state == "paused"
    elif slot.state is State.RUNNING and not slot.user_paused:
        assert dom_state == "running"


def _changes_follow_the_table(reg: RecordingRegistry, name: str, start: State = State.CREATING) -> None:
    prev = start
    for n, new in reg.changes:
        if n != name:
            continue
        assert valid_transition(prev, new), (prev, new)
        prev = new


def test_clone_compress_exec_resume_destroy_in_order(life: Lifecycle, rreg: RecordingRegistry, host: Any,
                                                      smem: SteppedMemory) -> None:
    (rec,) = life.clone_batch("base", names=["a-0"])
    assert rec["state"] == "running"
    out = life.compress("a-0")
    assert out["stored_pages"] == 1 and rreg.state_of("a-0") == ("compressed", None)
    assert host.doms["a-0"].state() == "paused" and "a-0" in rreg.paused_by_azq
    r = life.exec("a-0", ["true"])              # resumes the compressed sandbox first
    assert r["exit_code"] == 0 and r["prefetched_pages"] == 3
    assert rreg.state_of("a-0") == ("running", None) and host.doms["a-0"].state() == "running"
    life.compress("a-0")
    life.compress("a-0")                        # compressed again: allowed
    life.resume("a-0")
    life.destroy("a-0")
    assert smem.released == ["a-0"] and rreg.slots.get("a-0") is None
    assert [s for n, s in rreg.changes if n == "a-0"] == [
        State.RUNNING, State.COMPRESSING, State.COMPRESSED, State.RESUMING, State.RUNNING,
        State.COMPRESSING, State.COMPRESSED, State.COMPRESSING, State.COMPRESSED, State.RESUMING,
        State.RUNNING, State.DESTROYING]
    with pytest.raises(SandboxNotFound):
        life.compress("a-0")


def test_the_guest_clock_is_sent_each_time_azqemu_continues_the_vcpus(life: Lifecycle, host: Any,
                                                                      smem: SteppedMemory) -> None:
    """A paused guest's clock stands still: after a clone, a resume (of a compression or of
    the user's pause) and a compression that ended early the manager sends it the host's
    (daemon/guestclock.py); a sandbox left running and trims send nothing."""
    continued: list[str] = []
    life.on_vcpus_continued = continued.append
    life.clone_batch("base", names=["k-0"])
    assert continued == ["k-0"]
    life.resume("k-0")                          # running: nothing stood still
    life.compress("k-0")
    life.exec("k-0", ["true"])                  # the call's resume
    life.pause("k-0")
    life.resume("k-0")
    assert continued == ["k-0"] * 3
    smem.compress_error = StoreFull("/store", "no room for encoded pages")
    with pytest.raises(StoreFull):
        life.compress("k-0")                    # ended early: its vCPUs continue
    assert continued == ["k-0"] * 4 and host.doms["k-0"].state() == "running"


def test_store_full_leaves_the_sandbox_running_and_usable(life: Lifecycle, rreg: RecordingRegistry,
                                                          host: Any, smem: SteppedMemory) -> None:
    life.clone_batch("base", names=["f-0"])
    smem.compress_error = StoreFull("/store", "no room for encoded pages")
    with pytest.raises(StoreFull) as err:
        life.compress("f-0")
    assert err.value.exit_code == 75
    assert rreg.state_of("f-0") == ("running", None) and host.doms["f-0"].state() == "running"
    smem.compress_error = None
    life.compress("f-0")
    assert rreg.state_of("f-0") == ("compressed", None)


def test_a_crash_in_compress_fails_the_sandbox_and_only_destroy_is_left(
        life: Lifecycle, rreg: RecordingRegistry, host: Any, smem: SteppedMemory, memory: MemoryService) -> None:
    life.clone_batch("base", names=["k-0"])
    smem.compress_error = ZeroDivisionError("bug")
    with pytest.raises(ZeroDivisionError):
        life.compress("k-0")
    state, reason = rreg.state_of("k-0")
    assert state == "failed" and reason == "compression crashed: ZeroDivisionError: bug"
    for op in (lambda: life.compress("k-0"), lambda: life.resume("k-0"), lambda: life.exec("k-0", ["true"]),
               lambda: life.pause("k-0")):
        with pytest.raises(SandboxStateError) as err:
            op()
        assert (err.value.state, err.value.reason) == ("failed", reason)
    # Shown by list and dominfo, and kept in the record for a restarted daemon.
    acc = Accounting(rreg, memory)
    row = acc.describe(rreg.record("k-0"))
    assert (row["state"], row["failed_reason"], row["domain_state"]) == ("failed", reason, "paused")
    assert (rreg.record("k-0").state, rreg.record("k-0").failed_reason) == ("failed", reason)
    life.destroy("k-0")
    assert "k-0" not in host.doms


def test_an_unservable_page_at_resume_fails_the_sandbox(life: Lifecycle, rreg: RecordingRegistry,
                                                        smem: SteppedMemory) -> None:
    life.clone_batch("base", names=["p-0"])
    life.compress("p-0")
    smem.prefetch_error = PageUnavailable(0x5000, "store has no page 5 of 'p-0'")
    with pytest.raises(PageUnavailable):
        life.exec("p-0", ["true"])
    state, reason = rreg.state_of("p-0")
    assert state == "failed" and "store has no page 5" in (reason or "")
    life.destroy("p-0")


def test_compress_is_refused_while_a_command_runs(life: Lifecycle, rreg: RecordingRegistry, host: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    life.clone_batch("base", names=["x-0"])
    started, release = threading.Event(), threading.Event()

    class SlowAgent(FakeAgent):
        def exec(self, argv: list[str], timeout_s: float, stdin: bytes | None = None, on_output: Any = None,
                 exit_wait: Any = None) -> ExecResult:
            started.set()
            release.wait(5)
            return ExecResult(0, b"", b"", 0.0)

    monkeypatch.setattr(lifecycle_mod, "GuestAgent", SlowAgent)
    t = threading.Thread(target=life.exec, args=("x-0", ["sleep"]))
    t.start()
    assert started.wait(5)
    with pytest.raises(SandboxStateError, match=r"cannot compress \(a command runs in it"):
        life.compress("x-0")
    release.set()
    t.join(5)
    assert host.doms["x-0"].state() == "running"
    life.compress("x-0")


def _compress_in_thread(life: Lifecycle, name: str) -> tuple[threading.Thread, list[BaseException]]:
    """``life.compress(name)`` in a thread of its own, started; what it raised lands in the list."""
    errors: list[BaseException] = []

    def compress() -> None:
        try:
            life.compress(name)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    t = threading.Thread(target=compress)
    t.start()
    return t, errors


def test_destroy_cancels_a_compression_before_it_waits(life: Lifecycle, rreg: RecordingRegistry, host: Any,
                                                       smem: SteppedMemory) -> None:
    life.clone_batch("base", names=["d-0"])
    smem.steps, smem.step_s = 10_000, 0.001          # ten seconds unless cancelled
    t, errors = _compress_in_thread(life, "d-0")
    while rreg.state_of("d-0")[0] != "compressing":
        time.sleep(0.001)
    t0 = time.monotonic()
    life.destroy("d-0")
    assert time.monotonic() - t0 < 2.0
    t.join(5)
    assert len(errors) == 1 and isinstance(errors[0], CompressCancelled)
    assert "d-0" not in host.doms and rreg.slots.get("d-0") is None
    _changes_follow_the_table(rreg, "d-0")


def test_destroy_stops_a_compression_that_starts_after_its_cancel(
        life: Lifecycle, rreg: RecordingRegistry, host: Any, smem: SteppedMemory) -> None:
    """The compression has passed its destroy check when the destroy cancels; it then clears
    the plain cancel as it starts. The destroy's cancel is for good: it still stops at once."""
    life.clone_batch("base", names=["d-1"])
    smem.steps, smem.step_s = 10_000, 0.001
    smem.before_start = threading.Event()
    t, errors = _compress_in_thread(life, "d-1")
    assert smem.started.wait(5)
    d = threading.Thread(target=life.destroy, args=("d-1",))
    t0 = time.monotonic()
    d.start()
    while not rreg.slot("d-1").destroy_requested:
        time.sleep(0.001)
    time.sleep(0.05)                      # its cancel is in
    smem.before_start.set()
    d.join(5)
    t.join(5)
    assert time.monotonic() - t0 < 2.0
    assert len(errors) == 1 and isinstance(errors[0], CompressCancelled)
    assert "d-1" not in host.doms and rreg.slots.get("d-1") is None


@pytest.mark.parametrize("canceller", ["resume", "exec"])
def test_a_cancel_before_the_compression_starts_is_not_lost(
        life: Lifecycle, rreg: RecordingRegistry, host: Any, smem: SteppedMemory, canceller: str) -> None:
    """The compression has passed its checks (phase, execs) and not reached its first step
    when a resume or an exec cancels it: it clears its own flag as it starts, but its ticket
    is older than the cancel, so it stops at once and the caller does not wait ten seconds."""
    name = f"w-{canceller}"
    life.clone_batch("base", names=[name])
    smem.steps, smem.step_s = 10_000, 0.001
    smem.before_start = threading.Event()
    t, errors = _compress_in_thread(life, name)
    assert smem.started.wait(5)
    call = (lambda: life.resume(name)) if canceller == "resume" else (lambda: life.exec(name, ["true"]))
    c = threading.Thread(target=call)
    t0 = time.monotonic()
    c.start()
    time.sleep(0.05)                      # its cancel is in; it waits for the sandbox's lock
    smem.before_start.set()
    c.join(5)
    t.join(5)
    assert time.monotonic() - t0 < 2.0
    assert len(errors) == 1 and isinstance(errors[0], CompressCancelled)
    assert rreg.state_of(name)[0] == "running" and host.doms[name].state() == "running"
    _changes_follow_the_table(rreg, name)


OPS = st.sampled_from(["compress", "resume", "exec", "destroy", "pause"])


# Each example makes its own registry, memory and sandbox name: the fixtures only give the
# state directory and fake host they share.
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plans=st.lists(st.lists(OPS, min_size=1, max_size=5), min_size=2, max_size=5))
def test_any_interleaving_on_one_sandbox_has_one_defined_outcome(
        plans: list[list[str]], cfg: Any, host: Any, registry: Registry, memory: MemoryService,
        sandbox_meta_of: Any, template: TemplateMeta, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle_mod, "GuestAgent", FakeAgent)
    reg = RecordingRegistry(cfg, host, registry.templates, registry.sandboxes)
    smem = SteppedMemory(memory, steps=3)
    life = Lifecycle(reg, smem, clone_fn=_fake_clone(host, sandbox_meta_of), destroy_fn=lifecycle_mod.destroy)
    name = f"h-{len(reg.changes)}-{time.monotonic_ns()}"
    life.clone_batch("base", names=[name])
    barrier = threading.Barrier(len(plans))
    outcomes: list[tuple[str, str]] = []
    unexpected: list[BaseException] = []

    def run(plan: list[str]) -> None:
        barrier.wait()
        for op in plan:
            try:
                if op == "exec":
                    life.exec(name, ["true"])
                elif op == "resume":
                    life.resume(name)
                else:
                    getattr(life, op)(name)
                outcomes.append((op, "ok"))
            except DEFINED_ERRORS as exc:
                outcomes.append((op, type(exc).__name__))
            except BaseException as exc:  # noqa: BLE001
                unexpected.append(exc)

    threads = [threading.Thread(target=run, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "an operation hung"
    assert unexpected == []
    assert len(outcomes) == sum(len(p) for p in plans)          # exactly one outcome each
    _changes_follow_the_table(reg, name)
    _check_consistent(life, host, name)
    destroyed = ("destroy", "ok") in outcomes
    assert destroyed == (reg.slots.get(name) is None)
    if destroyed:
        assert smem.released == [name]                            # released once, not twice
    else:
        life.destroy(name)
    assert name not in host.doms


# -- the fault supervisor -----------------------------------------------------------------
class FakeHandler:
    def __init__(self) -> None:
        self.alive = True
        self.errors = 0
        self.last_error: BaseException | None = None
        self.starts = 0
        self.retry_calls = 0
        self.fix_on_retry = False
        self.error_factory: Any = lambda: OSError(5, "I/O error")

    @property
    def running(self) -> bool:
        return self.alive

    def retry_failed(self) -> int:
        self.retry_calls += 1
        if not self.fix_on_retry:
            self.fail_again()             # the page fails again
        return 1

    def fail_again(self) -> None:
        self.errors += 1
        self.last_error = self.error_factory()     # the handler records a new error each time

    def start(self, *, wake: bool = True) -> None:
        self.alive = True
        self.starts += 1

    def stop(self, timeout_s: float = 5.0) -> None:
        pass


class FakeHandle:
    pid = 0


class FakeMem:
    def __init__(self) -> None:
        self.registered = True
        self.handler = FakeHandler()
        self.handle = FakeHandle()

    def restart_handler(self) -> bool:   # as SandboxMemory.restart_handler
        if self.handler.running:
            return False
        self.handler.stop()
        self.handler.start(wake=True)
        return True


def _supervised(life: Lifecycle, name: str) -> tuple[FaultSupervisor, FakeMem]:
    mem = FakeMem()
    sup = FaultSupervisor(lambda: [(name, mem)], life.memory._fail, threading.Lock())  # type: ignore[list-item]
    sup.check_once(0.0)
    return sup, mem


def test_a_dead_handler_is_restarted_and_one_that_keeps_dying_fails_the_sandbox(
        life: Lifecycle, rreg: RecordingRegistry) -> None:
    life.clone_batch("base", names=["s-0"])
    sup, mem = _supervised(life, "s-0")
    for i in range(MAX_RESTARTS):
        mem.handler.alive = False
        mem.handler.last_error = OSError(9, "Bad file descriptor")
        sup.check_once(float(i))
        assert mem.handler.alive and mem.handler.starts == i + 1
    assert rreg.state_of("s-0") == ("running", None)
    mem.handler.alive = False
    sup.check_once(10.0)
    state, reason = rreg.state_of("s-0")
    assert state == "failed" and "fault handler died 4 times" in (reason or "")
    assert "Bad file descriptor" in (reason or "")
    with pytest.raises(SandboxStateError):
        life.exec("s-0", ["true"])
    life.destroy("s-0")


def test_an_unservable_page_is_retried_then_fails_the_sandbox(life: Lifecycle, rreg: RecordingRegistry) -> None:
    life.clone_batch("base", names=["u-0"])
    sup, mem = _supervised(life, "u-0")
    mem.handler.error_factory = lambda: PageUnavailable(0x7000, "store has no page 7 of 'u-0'")
    mem.handler.fail_again()
    for i in range(MAX_FAULT_RETRIES + 1):
        sup.check_once(float(i))
    assert mem.handler.retry_calls == MAX_FAULT_RETRIES
    state, reason = rreg.state_of("u-0")
    assert state == "failed" and "store has no page 7" in (reason or "") and "after 4 retries" in (reason or "")
    assert sup.failed == {"u-0": reason}


def test_a_passing_fault_error_is_retried_and_nothing_fails(life: Lifecycle, rreg: RecordingRegistry) -> None:
    life.clone_batch("base", names=["t-0"])
    sup, mem = _supervised(life, "t-0")
    mem.handler.fix_on_retry = True
    mem.handler.last_error = OSError(12, "Cannot allocate memory")
    sup.check_once(1.0)
    sup.check_once(2.0)
    sup.check_once(3.0)
    assert mem.handler.retry_calls == 1 and sup.retries == 1
    assert rreg.state_of("t-0") == ("running", None)


def test_a_handler_stopped_with_its_memory_detached_is_left_alone(life: Lifecycle, rreg: RecordingRegistry) -> None:
    life.clone_batch("base", names=["q-0"])
    sup, mem = _supervised(life, "q-0")
    mem.registered = False
    mem.handler.alive = False
    sup.check_once(1.0)
    assert mem.handler.starts == 0 and rreg.state_of("q-0") == ("running", None)


def test_exec_of_a_sandbox_without_agent_keeps_state_running(life: Lifecycle, rreg: RecordingRegistry,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    class NoAgent(FakeAgent):
        def exec(self, argv: list[str], timeout_s: float, stdin: bytes | None = None, on_output: Any = None,
                 exit_wait: Any = None) -> ExecResult:
            raise AgentError("not connected")

    life.clone_batch("base", names=["n-0"])
    monkeypatch.setattr(lifecycle_mod, "GuestAgent", NoAgent)
    with pytest.raises(AgentError):
        life.exec("n-0", ["true"])
    assert rreg.state_of("n-0") == ("running", None) and rreg.slot("n-0").execs == 0


@pytest.mark.parametrize(("policy", "vcpus_at_prefetch"), [("agentzip", "running"),
                                                           ("agentzip-prefetch-first", "paused")])
def test_a_tool_calls_resume_puts_the_hot_set_back_beside_the_call_or_first(
        life: Lifecycle, rreg: RecordingRegistry, smem: SteppedMemory, monkeypatch: pytest.MonkeyPatch,
        policy: str, vcpus_at_prefetch: str) -> None:
    life.clone_batch("base", names=["b-0"], policy=policy)
    life.compress("b-0")
    seen: list[tuple[str, str]] = []
    prefetch = smem.prefetch

    def watched(name: str, *, hot: bool, call: int | None = None, part: str = "all") -> dict[str, Any]:
        seen.append((part, life.reg.domain(name).state(), threading.current_thread().name))
        return prefetch(name, hot=hot, call=call, part=part)
    monkeypatch.setattr(smem, "prefetch", watched)
    res = life.exec("b-0", ["true"])
    if vcpus_at_prefetch == "running":
        # Beside: the pages the guest touched first last time before its vCPUs continue, the
        # rest in a helper thread while the call runs.
        assert [p for p, _, _ in seen] == ["early", "rest"]
        assert seen[0][1] == "paused" and not seen[0][2].startswith("azq-resume")
        assert seen[1][1] == "running" and seen[1][2].startswith("azq-resume")
    else:
        assert [(p, s) for p, s, _ in seen] == [("all", "paused")]
    assert res["prefetched_pages"] == 3 and res["exit_code"] == 0      # joined before the call returned
    assert rreg.state_of("b-0")[0] == "running"
    life.destroy("b-0")
