"""Guest wall clocks kept to the host's across pauses and clones.

QEMU stops a guest's virtual clock with its vCPUs, so a sandbox paused for a compressed LLM
wait comes back behind by as long as it was paused, and a clone starts at the time its
template was saved (hours or days before). Tools see it: make compares mtimes with files
copied in from the host, TLS and tokens have validity windows, signed API requests are refused
past a few minutes of skew (AWS SigV4: 15). Each time azqemu continues a sandbox's vCPUs (a
clone started, a resume, a compression that ended early) it sends the host's wall clock to the
in-guest agent, which steps the guest's clock to it (guest-agent/azq_guest_agent.py, the
``clock`` command; its answer is counted in the channel's stats). CLOCK_MONOTONIC stays as the
guest kept it.

Why not QEMU's guest agent: guest-set-time (libvirt's virDomainSetTime, which Nova calls after
a resume) runs ``hwclock -w`` after setting the clock, which waits for the RTC's next second:
~1 s per call measured here, on the tool call's path and holding qemu-ga's next guest-exec.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from azqemu.sched.agent_channel import encode_command

log = logging.getLogger(__name__)

Send = Callable[[str, Callable[[], bytes]], bool]


class GuestClock:
    """``sync(name)``: the host's wall clock to the sandbox's agent, read as it is written."""

    def __init__(self, send: Send) -> None:
        self._send = send

    def sync(self, name: str) -> bool:
        """Never raises: a guest whose clock cannot be set runs on with its own. What the
        guests answered is counted in their channels' stats (``clock_steps``)."""
        try:
            ok = self._send(name, lambda: encode_command("clock", realtime_ns=time.time_ns()))
        except Exception:  # noqa: BLE001 - the resume it follows has succeeded either way
            log.exception("%s: sending the clock failed", name)
            return False
        if not ok:
            log.debug("%s: no agent channel to send the clock to (an image without our agent?)", name)
        return ok
