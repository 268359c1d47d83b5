"""Guest wall clocks under real QEMU: a paused guest's clock stands still, so azqemu sends the
host's after a clone (which starts at its template's saved time), after a compressed wait and
after the user's pause (daemon/guestclock.py, the in-guest agent's clock command)."""

from __future__ import annotations

import time

import pytest

from azqemu.client import Client
from tests.support.guest import needs_lazy_restore, sh

pytestmark = [pytest.mark.vm, pytest.mark.root]

# What a guest's clock may be off by, read through an exec (a guest-exec and its status polls
# take ~0.1-0.3 s under TCG; the step itself is exact to a millisecond or two).
SLACK_S = 1.0


def guest_skew_s(name: str) -> float:
    """How far the guest's wall clock is from the host's, read inside one exec."""
    before = time.time()
    code, out = sh(name, "date +%s.%N")
    after = time.time()
    assert code == 0, out
    guest = float(out)
    return 0.0 if before - SLACK_S <= guest <= after + SLACK_S else guest - after


def test_the_guest_clock_follows_the_host_across_clone_pause_and_compression(template: str) -> None:
    c = Client()
    created = next(t.created_at for t in c.template_list() if t.name == template)
    time.sleep(max(0.0, created + 3 * SLACK_S - time.time()))   # its saved clock is behind by then
    (rec,) = c.clone(template=template, count=1, name_prefix="clk-")
    name = rec.name
    try:
        assert guest_skew_s(name) == 0.0          # the first command already sees the host's time
        c.pause(name=name)
        time.sleep(3 * SLACK_S)
        c.resume(name=name)
        assert guest_skew_s(name) == 0.0
        needs_lazy_restore()
        st = c.compress(name=name)
        assert st.stored_pages > 0
        time.sleep(3 * SLACK_S)                   # an LLM wait: the guest stands still
        assert guest_skew_s(name) == 0.0          # exec resumed it and its clock
        channel = c.dominfo(name).model_extra["agent_channel"]
        assert channel["clock_steps"] >= 3 and channel["rejected_schema"] == 0
        # libvirt's own way (virsh domtime --time, Nova's sync after a resume) works too: qemu-ga
        # runs hwclock -w, which needs a writable /etc/adjtime in a read-only root.
        import libvirt

        conn = libvirt.open("qemu:///system")
        try:
            now = time.time_ns()
            conn.lookupByName(name).setTime({"seconds": now // 10**9, "nseconds": now % 10**9})
        finally:
            conn.close()
        assert guest_skew_s(name) == 0.0
    finally:
        c.destroy(name=name)
