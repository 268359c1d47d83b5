"""A pooled connection is never reused once the daemon may be closing it: the client's
keep-alive expiry is shorter than the daemon's (a request sent on a connection uvicorn closes
at that instant fails with "Connection reset by peer"). Served for real (uvicorn on a unix
socket), both keep-alives shortened so the test runs in seconds."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from azqemu import client as client_mod
from azqemu.daemon import server as server_mod
from tests.unit.api.conftest import Served


def test_the_clients_keepalive_is_well_under_the_daemons() -> None:
    assert client_mod.KEEPALIVE_S <= server_mod.KEEP_ALIVE_S / 2


@pytest.fixture
def short_keepalives(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(server_mod, "KEEP_ALIVE_S", 1.0)     # uvicorn takes whole seconds
    monkeypatch.setattr(client_mod, "KEEPALIVE_S", 0.3)
    yield


def test_requests_spaced_at_the_daemons_keepalive_all_succeed(short_keepalives: None, served: Served) -> None:
    """Requests idle for just about the daemon's keep-alive, when it closes the connection:
    with the client's expiry shorter, each goes out on a new connection and none fails. (The
    race itself is a window of a fraction of a millisecond on an idle daemon: this does not
    make it happen on demand, only checks the spacing that invites it.)"""
    pings = []
    for gap_s in (0.98, 1.0, 1.03):
        pings.append(served.client.ping().pid)
        time.sleep(gap_s)
    pings.append(served.client.ping().pid)
    assert len(set(pings)) == 1
