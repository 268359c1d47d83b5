"""The Placement client's own parts: the inventory body, the provider identity kept under the
state dir, URL checks and an unreachable service as one error (a real Placement service is in
tests/integration/test_placement.py)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from azqemu import placement
from azqemu.errors import ConfigError, PlacementError


def test_memory_inventory_clamps_reserved_to_total() -> None:
    inv = placement.memory_inventory(1000, 1500, 2.5)
    assert inv == {"total": 1000, "reserved": 1000, "min_unit": 1, "max_unit": 1000, "step_size": 1,
                   "allocation_ratio": 2.5}


def test_provider_identity_is_made_once_and_kept(tmp_path: Path) -> None:
    name, uid = placement.provider_identity(tmp_path, "host-a")
    assert name == "host-a"
    assert placement.provider_identity(tmp_path) == ("host-a", uid)
    assert json.loads((tmp_path / "placement.json").read_text()) == {"name": "host-a", "uuid": uid}


def test_provider_identity_defaults_to_the_host_name(tmp_path: Path) -> None:
    assert placement.provider_identity(tmp_path)[0] == socket.gethostname()


@pytest.mark.parametrize("url", ["placement.example", "ftp://x", ""])
def test_url_must_be_http(url: str) -> None:
    with pytest.raises(ConfigError):
        placement.Placement(url)


def test_unreachable_service_is_one_placement_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(PlacementError, match="cannot reach Placement") as err:
        placement.Placement(f"http://127.0.0.1:{port}", timeout_s=2).provider("x")
    assert "\n" not in str(err.value)


def test_keystone_is_not_used_without_os_auth_url() -> None:
    assert placement.keystone_login({}) is None
    with pytest.raises(ConfigError, match="OS_PASSWORD"):
        placement.keystone_login({"OS_AUTH_URL": "http://k:5000", "OS_USERNAME": "u", "OS_PROJECT_NAME": "p"})
