"""The daemon's side of scheduling against a fake host: compress only in a wait, a 'tool'
hint resumes what azqemu paused, policies persist, agent sockets come from the identity."""

from __future__ import annotations

from typing import Any

import pytest

from azqemu.daemon.accounting import Accounting
from azqemu.daemon.lifecycle import Lifecycle
from azqemu.daemon.memsvc import MemoryService
from azqemu.daemon.registry import Registry
from azqemu.daemon.schedsvc import SchedService
from azqemu.daemon.states import State
from azqemu.errors import ConfigError, SandboxNotFound
from azqemu.sched import policy as policy_mod
from azqemu.sched.actions import SchedState
from azqemu.sched.agent_channel import AgentMessage
from azqemu.virt.clones import SandboxRecord
from azqemu.virt.identity import new_identity


def _msg(sandbox: str) -> AgentMessage:
    return AgentMessage(sandbox=sandbox, event="busy", phase="tool", seq=1, guest_t_s=0.0,
                        received_s=0.0)


@pytest.fixture
def svc(registry: Registry, memory: MemoryService, host: Any, sandbox_meta_of: Any) -> SchedService:
    for n in ("s0", "s1"):
        host.add(n, sandbox_meta_of(), pid=4242)
        registry.sandboxes.save(SandboxRecord(n, "base", "default", "eager", "u", 0.0, policy="agentzip"))
        registry.sched[n] = SchedState(policy_mod.get("agentzip"))
    return SchedService(registry, Lifecycle(registry, memory), Accounting(registry, memory))


def test_compress_if_idle_acts_only_in_a_wait(svc: SchedService, host: Any) -> None:
    st = svc.sched_states["s0"]
    st.tracker.exec_started()
    svc.compress_if_idle("s0", st)  # a tool call in flight: nothing happens
    st.tracker.hint("tool")
    svc.compress_if_idle("s0", st)  # no tool call in flight, but no wait either
    st.tracker.exec_ended()         # now it waits: the compression is tried (and refused
    with pytest.raises(ConfigError, match="cannot compress 's0'"):  # here: no userfaultfd)
        svc.compress_if_idle("s0", st)
    assert host.doms["s0"].state() == "running"


def test_compress_if_idle_skips_a_sandbox_no_longer_scheduled(svc: SchedService, registry: Registry) -> None:
    st = registry.sched.pop("s0")
    st.tracker.hint("wait")
    svc.compress_if_idle("s0", st)  # destroyed meanwhile: no error, nothing done


def test_tool_hint_resumes_a_sandbox_azqemu_paused(svc: SchedService, registry: Registry, host: Any) -> None:
    host.doms["s0"].suspend()
    registry.settle("s0", State.COMPRESSED)
    host.doms["s1"].suspend()  # paused by its user: a hint does not resume it
    out = svc.phase("s0", "tool")
    assert out["name"] == "s0" and out["phase"] == "tool" and "resume_s" in out
    assert host.doms["s0"].state() == "running" and "s0" not in registry.paused_by_azq
    assert svc.phase("s1", "tool") == {"name": "s1", "phase": "tool"}
    assert host.doms["s1"].state() == "paused"
    assert svc.sched_states["s0"].tracker.current().source == "hint"


def test_phase_refuses_unknown_phases_and_sandboxes(svc: SchedService) -> None:
    with pytest.raises(ConfigError, match="unknown phase 'thinking'"):
        svc.phase("s0", "thinking")
    with pytest.raises(SandboxNotFound):
        svc.phase("nope", "wait")


def test_set_policy_persists_and_starts_the_phases_over(svc: SchedService, registry: Registry) -> None:
    old = registry.sched["s0"]
    svc.set_policy(["s0"], "linux", grace_s=4.0)
    rec = registry.record("s0")
    assert (rec.policy, rec.grace_s) == ("linux", 4.0)
    assert registry.sched["s0"] is not old
    assert (registry.sched["s0"].policy.name, registry.sched["s0"].grace_s) == ("linux", 4.0)
    with pytest.raises(ConfigError, match="unknown policy 'fast'"):
        svc.set_policy(["s1"], "fast")
    assert registry.record("s1").policy == "agentzip"


def test_actions_read_the_host(svc: SchedService) -> None:
    assert svc.qemu_pid("s0") == 4242
    assert svc.qemu_pid("nope") is None
    assert svc.resident_bytes("nope") is None


def test_agent_sockets_are_the_identity_paths_and_messages_move_their_own_sandbox(svc: SchedService) -> None:
    socks = svc.agent_sockets()
    assert socks == {n: new_identity(n).azq_agent_socket for n in ("s0", "s1")}
    svc.on_agent_message("s1", _msg("s1"))
    assert svc.sched_states["s1"].tracker.current().phase == "tool"
    assert svc.sched_states["s0"].tracker.current().phase == "unknown"
    svc.on_agent_message("gone", _msg("gone"))  # ignored
