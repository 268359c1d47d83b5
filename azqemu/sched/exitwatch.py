"""When a guest-exec'd command ends, as the in-guest agent saw it: exec waits for that word
instead of asking the QEMU guest agent over and over.

``azq exec`` runs a command with guest-exec and asks guest-exec-status until it has exited.
Each question is a libvirt agent call (a guest-sync handshake and the command, each a round
trip through qemu-ga in the guest): polled every 50 ms, one sandbox in a 4 s ``sleep`` cost
10% of a core in QEMU and 3.5% in libvirtd (measured: docs/figures.md, session 12), paid by
every sandbox in a tool call, beside the guests that do the work.

The in-guest agent reports a tool's start and end (the kernel's process events: at the exec
and at the exit of qemu-ga's child, whatever its length) on the sandbox's own channel. Once it
reported the start of the pid guest-exec gave, exec waits for the end here and asks the
status then, with a slow poll behind it (``agent.EXIT_WAIT_POLL_S``) should the report be lost. The
guest is not trusted: what it says only decides *when* exec asks qemu-ga, never the result; a
false end costs one status call, a missing one the fallback's delay to that guest alone.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from azqemu.sched.agent_channel import AgentMessage

# Pids remembered per sandbox (started, and ended not yet waited for): a tool-end can arrive
# before exec asks for it, and a guest that floods reports holds no more than this.
REMEMBERED_PIDS = 64


class ExitWatch:
    """Tool starts and ends of guest-exec'd commands, per sandbox."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._started: dict[str, OrderedDict[int, None]] = {}
        self._ended: dict[str, OrderedDict[int, None]] = {}

    def note(self, sandbox: str, msg: AgentMessage) -> None:
        """An accepted in-guest agent message of ``sandbox`` (``AgentLinks``' on_message)."""
        if msg.source != "guest-exec" or msg.pid is None or msg.event not in ("tool-start", "tool-end"):
            return
        with self._cond:
            book = self._started if msg.event == "tool-start" else self._ended
            pids = book.setdefault(sandbox, OrderedDict())
            pids[msg.pid] = None
            pids.move_to_end(msg.pid)
            while len(pids) > REMEMBERED_PIDS:
                pids.popitem(last=False)
            if msg.event == "tool-end":
                self._cond.notify_all()

    def wait_exit(self, sandbox: str, pid: int, timeout_s: float) -> bool | None:
        """Wait up to ``timeout_s`` for the agent to report ``pid``'s end: True when it did
        (the pid is then forgotten), False on timeout, None at once when the agent has not
        reported the command's start (no agent, or not yet: the caller polls as before)."""
        with self._cond:
            started = self._started.get(sandbox)
            if started is None or pid not in started:
                return None

            def ended() -> bool:
                return pid in self._ended.get(sandbox, ())
            if not self._cond.wait_for(ended, timeout_s):
                return False
            del self._ended[sandbox][pid]
            started.pop(pid, None)
            return True

    def forget(self, sandbox: str) -> None:
        """The sandbox is gone."""
        with self._cond:
            self._started.pop(sandbox, None)
            self._ended.pop(sandbox, None)
