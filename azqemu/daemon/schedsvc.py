"""The daemon's side of scheduling: what the scheduler may do, and what feeds the phases.

``SchedService`` implements ``sched.actions.SchedActions`` for the scheduler (compress a
sandbox still waiting, compress and run on, page out, QEMU's pid and resident bytes) on top
of the lifecycle and accounting services. It also takes the phase observations that do not
come from azqemu's own exec calls: an orchestrator's hints (``azq phase``) and the in-guest
agent's reports, and sets a sandbox's policy.

It publishes a ``phase`` event whenever a sandbox's phase moves (tool, wait, a new wait),
with the ``signal`` that decided it (hint, exec, agent, host). Hints and agent reports are
seen as they arrive; exec calls and host samples feed the trackers elsewhere, so the phases
are also looked at whenever the scheduler reads ``sched_states`` (every tick, 0.1 s): a tool
call shorter than a tick may show only as the new wait it ended with.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from azqemu.daemon.accounting import Accounting
from azqemu.daemon.eventlog import Publish, discard
from azqemu.daemon.lifecycle import Lifecycle
from azqemu.daemon.registry import Registry
from azqemu.daemon.states import State
from azqemu.errors import ConfigError
from azqemu.host.reclaim import pageout
from azqemu.sched import policy as policy_mod
from azqemu.sched.actions import SchedState
from azqemu.sched.agent_channel import AgentMessage
from azqemu.sched.phases import UNKNOWN
from azqemu.sched.policy import TRIM_EVERY_S
from azqemu.virt.identity import vm_paths


class SchedService:
    def __init__(self, registry: Registry, lifecycle: Lifecycle, accounting: Accounting, *,
                 publish: Publish = discard) -> None:
        self.reg = registry
        self.lifecycle = lifecycle
        self.accounting = accounting
        self.publish = publish
        self._phase_mu = threading.Lock()
        self._published_phase: dict[str, tuple[str, float]] = {}   # name -> (phase, since_s)

    def note_phases(self) -> None:
        """Publish the phase of every sandbox whose phase moved since it was last published."""
        states = dict(self.reg.sched)
        for name, st in states.items():
            self._note_phase(name, st)
        with self._phase_mu:
            for gone in set(self._published_phase) - set(states):
                del self._published_phase[gone]

    def _note_phase(self, name: str, st: SchedState) -> None:
        ph = st.tracker.current()
        if ph.phase == UNKNOWN:
            return      # nothing seen yet (its since_s is "now" at every call)
        with self._phase_mu:
            if self._published_phase.get(name) == (ph.phase, ph.since_s):
                return
            self._published_phase[name] = (ph.phase, ph.since_s)
            self.publish(name, "phase", f"{ph.phase} ({ph.source})", phase=ph.phase, signal=ph.source)

    # -- sched.actions.SchedActions ------------------------------------------------------
    @property
    def sched_states(self) -> Mapping[str, SchedState]:
        # The scheduler's once-per-tick look: phases moved by exec calls and host samples
        # are published from here.
        self.note_phases()
        return self.reg.sched

    def compress_if_idle(self, name: str, st: SchedState) -> None:
        """Compress a sandbox that is still waiting for its LLM (the scheduler's call)."""
        with self.reg.lock(name):
            # Before the phase check: a tool call seen after it cancels this compression
            # (phase() and exec cancel after they move the tracker).
            ticket = self.lifecycle.memory.cancel_ticket(name)
            if st.tracker.in_tool_call() or st.tracker.current().phase != "wait":
                return
            if name not in self.reg.sched:
                return
            slot = self.reg.find_slot(name)
            if slot is None or slot.state not in (State.RUNNING, State.COMPRESSED) or slot.destroy_requested:
                return      # failed, or going: nothing for the scheduler to do
            self.lifecycle.compress_locked(name, ticket)

    def compress_and_run_on(self, name: str) -> None:
        """The pressure ablation: compress, then let the sandbox run on, served lazily."""
        with self.reg.lock(name):
            self.lifecycle.compress_locked(name)
            self.lifecycle.resume_locked(name, self.reg.domain(name), prefetch=False)

    def trim_if_running(self, name: str) -> None:
        """Trim a sandbox that is still in a tool call (the scheduler's call)."""
        st = self.reg.sched.get(name)
        mem = self.lifecycle.memory.get(name)
        # Not due (its cold age is long: its dropped pages kept coming back): no pause at all.
        if (st is not None and st.tracker.current().phase == "tool" and mem is not None
                and mem.trim_due(TRIM_EVERY_S, st.policy.trim_backoff)):
            self.lifecycle.trim(name)

    def pageout(self, name: str) -> None:
        """The linux policy's proactive reclaim: push an idle sandbox's RAM out to zram."""
        pid = self.qemu_pid(name)
        if pid is not None:
            pageout(pid, backing="ram.img")

    def qemu_pid(self, name: str) -> int | None:
        return self.accounting.qemu_pid(name)

    def resident_bytes(self, name: str) -> int | None:
        return self.accounting.resident_bytes(name)

    # -- phases and policies -----------------------------------------------------------
    def phase(self, name: str, phase: str) -> dict[str, Any]:
        """An orchestrator's hint: 'wait' (the agent waits for its LLM) or 'tool' (a tool call
        is coming: a compressed sandbox is resumed with its hot set now, ahead of it)."""
        self.reg.record(name)
        st = self.reg.sched.get(name)
        if st is None:
            raise ConfigError(f"{name!r} has no scheduling state")
        try:
            st.tracker.hint(phase)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self._note_phase(name, st)
        out: dict[str, Any] = {"name": name, "phase": phase}
        if phase == "tool":
            # Also when not paused yet: a compression decided before the hint, which has not
            # reached its first step, stops there (MemoryService.cancel_ticket).
            self.lifecycle.memory.cancel(name)
        if phase == "tool" and name in self.reg.paused_by_azq:
            with self.reg.lock(name):
                if name in self.reg.paused_by_azq:
                    out.update(self.lifecycle.resume_locked(name, self.reg.domain(name),
                                                            prefetch=st.policy.prefetch))
        return out

    def set_policy(self, names: list[str], policy: str, grace_s: float | None = None) -> None:
        """Record a new policy (and grace period) for sandboxes; their phases start over."""
        pol = policy_mod.get(policy)
        for n in names:
            rec = self.reg.record(n)
            fields: dict[str, object] = {"policy": pol.name}
            if grace_s is not None:
                fields["grace_s"] = float(grace_s)
            rec = self.reg.update_record(n, **fields) or rec   # never over a state change
            self.reg.sched[n] = SchedState(pol, grace_s=rec.grace_s)

    def agent_sockets(self) -> dict[str, Path]:
        """The in-guest agent channel of every scheduled sandbox (for ``AgentLinks``)."""
        return {n: vm_paths(n, self.reg.cfg).azq_agent_socket for n in list(self.reg.sched)}

    def on_agent_message(self, name: str, msg: AgentMessage) -> None:
        self.reg.exits.note(name, msg)
        st = self.reg.sched.get(name)
        if st is not None:
            st.tracker.agent_event(msg.phase)
            self._note_phase(name, st)
