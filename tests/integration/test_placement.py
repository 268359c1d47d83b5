"""Capacity and OpenStack Placement: ``azq capacity`` and ``azq placement sync`` against a real
Placement service (openstack-placement from its own venv, noauth2, sqlite), read back over HTTP.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from azqemu.client import Client
from azqemu.host.procfs import read_meminfo
from azqemu.units import MIB
from tests.support import services

pytestmark = [pytest.mark.vm, pytest.mark.root]


@pytest.fixture()
def placement_url() -> Iterator[str]:
    work = Path(tempfile.mkdtemp(prefix="azq-placement-"))
    try:
        with services.placement(work) as url:
            yield url
    finally:
        shutil.rmtree(work, ignore_errors=True)


def get(url: str) -> dict:
    req = urllib.request.Request(url, headers={"x-auth-token": "admin",
                                               "OpenStack-API-Version": "placement 1.26"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"x-auth-token": "admin", "OpenStack-API-Version": "placement 1.26",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def test_capacity_and_placement_sync(template: str, azq, placement_url: str, azq_env: dict,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AZQ_CAPACITY_RESERVE", "300M")
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix="cap-")
    try:
        r = azq("capacity", "--json", "--template", template)
        assert r.returncode == 0, r.stderr
        cap = json.loads(r.stdout)
        assert cap["source"] == "running" and cap["measured_sandboxes"] == 1
        assert cap["guest_bytes"] == 512 * MIB and cap["cost_bytes"] > 0
        assert cap["reserve_bytes"] == 300 * MIB
        assert cap["allocation_ratio"] == pytest.approx(cap["guest_bytes"] / cap["cost_bytes"], rel=1e-3)
        assert cap["fits"] == max(0, (cap["mem_available_bytes"] - cap["reserve_bytes"]) // cap["cost_bytes"])

        assert get(f"{placement_url}/resource_providers")["resource_providers"] == []
        r = azq("placement", "sync", "--url", placement_url, "--json", "--template", template)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        rp = out["provider"]
        assert rp["created"] and out["before"] is None
        saved = json.loads((Path(azq_env["AZQ_STATE_DIR"]) / "placement.json").read_text())
        assert saved["uuid"] == rp["uuid"]
        inv = get(f"{placement_url}/resource_providers/{rp['uuid']}/inventories")
        mem = inv["inventories"]["MEMORY_MB"]
        used = out["capacity"]
        assert mem["total"] == read_meminfo()["MemTotal"] // MIB
        assert mem["reserved"] == -(-(used["manager_bytes"] + used["store_bytes"] + 300 * MIB) // MIB)
        assert mem["allocation_ratio"] == pytest.approx(used["allocation_ratio"], rel=1e-4)
        assert inv["resource_provider_generation"] == rp["generation"]

        # Someone else moves the provider's generation: the next sync reads it and succeeds.
        post(f"{placement_url}/resource_providers/{rp['uuid']}/inventories",
             {"resource_provider_generation": rp["generation"], "resource_class": "VCPU", "total": 2})
        moved = get(f"{placement_url}/resource_providers/{rp['uuid']}")["generation"]
        r = azq("placement", "sync", "--url", placement_url, "--json", "--template", template, "--reserve", "400M")
        assert r.returncode == 0, r.stderr
        out2 = json.loads(r.stdout)
        assert not out2["provider"]["created"] and out2["provider"]["uuid"] == rp["uuid"]
        assert out2["provider"]["generation"] == moved + 1
        assert out2["before"]["total"] == mem["total"]
        inv2 = get(f"{placement_url}/resource_providers/{rp['uuid']}/inventories")
        assert inv2["inventories"]["MEMORY_MB"]["reserved"] == out2["inventory"]["reserved"]
        assert out2["inventory"]["reserved"] >= 400
        assert inv2["inventories"]["VCPU"]["total"] == 2  # left alone
        assert len(get(f"{placement_url}/resource_providers")["resource_providers"]) == 1
    finally:
        c.destroy(name=rec.name)


def test_placement_sync_bad_url_is_one_line(template: str, azq) -> None:
    dead = f"http://127.0.0.1:{services.free_port()}"
    r = azq("placement", "sync", "--url", dead)
    assert r.returncode != 0
    assert r.stderr.count("\n") == 1 and "cannot reach Placement" in r.stderr, r.stderr
    r = azq("placement", "sync", "--url", "placement.example")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
