"""Phase detection: is a sandbox in a tool call or waiting for its LLM?

Sources, strongest first (DESIGN.md, "Phase detection"):
1. explicit hints from the orchestrator (``azq phase SANDBOX wait|tool``, the daemon's API);
2. tool calls azqemu runs itself (``azq exec``): a call in flight is a tool phase, and the
   end of the last call starts a wait;
3. the in-guest agent (guest-agent/): tool processes starting and ending, the guest idle;
4. host signals: the QEMU process's CPU time (an idle guest barely runs).
Hints and azqemu's own exec calls form one stream, the newest event wins; the in-guest agent
and host signals are only listened to for sandboxes where that stream is silent (an
orchestrator that neither hints nor execs through azqemu). Whatever the guest reports can
only move its own sandbox between tool and wait.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

TOOL, WAIT, UNKNOWN = "tool", "wait", "unknown"
# Host signal: a guest whose QEMU used less than this share of a CPU over the window is idle.
# Under TCG an idle Linux guest costs ~1-3% of a core (timer ticks); a tool call far more.
IDLE_CPU_FRACTION = 0.08
IDLE_WINDOW_S = 2.0


@dataclass(frozen=True)
class Phase:
    phase: str
    since_s: float      # time.monotonic() when this phase began
    source: str         # hint | exec | agent | host | none


class PhaseTracker:
    """The phase of one sandbox, fed by every source (thread-safe)."""

    def __init__(self, clock=time.monotonic) -> None:  # noqa: ANN001 - a monotonic clock
        self._clock = clock
        self._lock = threading.Lock()
        self._execs = 0
        self._exec_start_s = 0.0
        self._stream: Phase | None = None        # hints and exec ends
        self._agent: Phase | None = None
        self._host: Phase | None = None

    def hint(self, phase: str) -> None:
        if phase not in (TOOL, WAIT):
            raise ValueError(f"unknown phase {phase!r} (tool, wait)")
        with self._lock:
            if self._stream is None or self._stream.phase != phase or self._stream.source != "hint":
                self._stream = Phase(phase, self._clock(), "hint")

    def exec_started(self) -> None:
        with self._lock:
            if self._execs == 0:
                self._exec_start_s = self._clock()
            self._execs += 1

    def exec_ended(self) -> None:
        with self._lock:
            self._execs = max(0, self._execs - 1)
            if self._execs == 0:
                self._stream = Phase(WAIT, self._clock(), "exec")

    def agent_event(self, phase: str) -> None:
        with self._lock:
            if self._agent is None or self._agent.phase != phase:
                self._agent = Phase(phase, self._clock(), "agent")

    def host_sample(self, cpu_fraction: float) -> None:
        phase = WAIT if cpu_fraction < IDLE_CPU_FRACTION else TOOL
        with self._lock:
            if self._host is None or self._host.phase != phase:
                self._host = Phase(phase, self._clock(), "host")

    def current(self) -> Phase:
        with self._lock:
            if self._execs:
                return Phase(TOOL, self._exec_start_s, "exec")
            for p in (self._stream, self._agent, self._host):
                if p is not None:
                    return p
            return Phase(UNKNOWN, self._clock(), "none")

    def in_tool_call(self) -> bool:
        with self._lock:
            return self._execs > 0
