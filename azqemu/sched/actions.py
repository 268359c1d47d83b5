"""What the scheduler may do to sandboxes, and what it keeps per sandbox.

The scheduler decides when; whoever runs it (the daemon) does the work. ``SchedActions`` is
the whole of what the scheduler asks of its host, so the scheduler needs no manager and
imports nothing of the daemon: the daemon's ``SchedService`` implements it, the unit tests a
fake that records the calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from azqemu.sched.phases import PhaseTracker
from azqemu.sched.policy import DEFAULT_GRACE_S, Policy


@dataclass
class SchedState:
    """What the scheduler knows of one sandbox."""

    policy: Policy
    grace_s: float = DEFAULT_GRACE_S
    tracker: PhaseTracker = field(default_factory=PhaseTracker)
    acted_on_wait_s: float = -1.0      # since_s of the wait already acted on
    trimmed_at_s: float = -1.0         # when the last trim in a tool call was queued
    pending: Future[object] | None = None
    cpu_prev: tuple[float, float] | None = None   # (monotonic, QEMU cpu seconds)


class SchedActions(Protocol):
    """The actions the scheduler takes on sandboxes (all called from its threads)."""

    @property
    def sched_states(self) -> Mapping[str, SchedState]:
        """The sandboxes to schedule, by name (the scheduler iterates over a copy)."""
        ...

    def compress_if_idle(self, name: str, st: SchedState) -> None:
        """Compress ``name`` if it still waits for its LLM (no tool call began meanwhile)."""
        ...

    def compress_and_run_on(self, name: str) -> None:
        """Compress ``name`` and let it run on, its pages served on first touch."""
        ...

    def trim_if_running(self, name: str) -> None:
        """Drop the copies ``name`` holds that equal their stored entries, if it still runs a
        tool call (vCPUs paused meanwhile; see policy.TRIM_AFTER_S)."""
        ...

    def pageout(self, name: str) -> None:
        """Page the RAM of ``name`` out to zram (the linux policy's proactive reclaim)."""
        ...

    def qemu_pid(self, name: str) -> int | None:
        """The pid of the QEMU that runs ``name``, or None if it does not run."""
        ...

    def resident_bytes(self, name: str) -> int | None:
        """Guest RAM the host holds for ``name`` alone, or None if unknown."""
        ...
