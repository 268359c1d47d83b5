"""``azq events``' readable line: libvirt's events as before, azqemu's with their key figures."""

from __future__ import annotations

from azqemu.api.models import Event
from azqemu.cli.events_cmds import line


def test_a_libvirt_event_is_its_detail() -> None:
    e = Event(time=0.0, sandbox="a-0", event="suspended", detail="paused", source="libvirt")
    assert line(e).split()[1:] == ["a-0", "libvirt", "suspended", "paused"]


def test_azqemu_events_show_their_figures() -> None:
    done = Event.model_validate({"time": 0.0, "sandbox": "a-0", "event": "compress", "detail": "done",
                                 "source": "azqemu", "stored_bytes": 3 << 20, "stored_pages": 812,
                                 "duration_s": 0.41})
    assert line(done).endswith("azqemu  compress   done  [stored 3.0 MiB, 812 pages, 0.410 s]")
    failed = Event(time=0.0, sandbox="a-0", event="failed", detail="a page cannot be served",
                   source="azqemu", reason="a page cannot be served", state="compressed")
    assert line(failed).endswith("failed     a page cannot be served")
    resume = Event.model_validate({"time": 0.0, "sandbox": "a-0", "event": "resume", "detail": "failed",
                                   "source": "azqemu", "reason": "StoreCorrupt: bad checksum", "duration_s": 0.002})
    assert line(resume).endswith("resume     failed  [0.002 s, StoreCorrupt: bad checksum]")
    assert done.as_json() == {"time": 0.0, "sandbox": "a-0", "event": "compress", "detail": "done",
                              "source": "azqemu", "stored_bytes": 3 << 20, "stored_pages": 812, "duration_s": 0.41}
