"""The fill check (``azq bench fill``) with real sandboxes in a real memory cgroup: it fills,
stops for the right reason, and puts back everything it changed (the manager's cgroup and OOM
score, the cgroup itself, the sandboxes, the host's swap and KSM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from azqemu.bench import fill
from azqemu.bench.workload import load
from azqemu.client import Client
from azqemu.errors import HostError
from azqemu.host import memcg
from azqemu.host.linuxmm import HostSnapshot

pytestmark = [pytest.mark.vm, pytest.mark.root]
WORKLOAD = Path(__file__).parent / "data" / "deterministic.yaml"
MIB = 1 << 20


def _manager_state(pid: int, version: int) -> tuple[str, str]:
    with open(f"/proc/{pid}/oom_score_adj") as f:
        return memcg._own_cgroup(pid, version), f.read().strip()


def _version() -> int:
    try:
        cg = memcg.MemoryCgroup("azq-itest-probe", 64 * MIB)
    except HostError as exc:
        pytest.skip(f"no memory cgroup here: {exc}")
    cg.close()
    return cg.version


def _left_cgroups(version: int) -> list[Path]:
    root = memcg._v2_root(memcg.CGROUP_ROOT) if version == 2 else memcg.CGROUP_ROOT / "memory"
    assert root is not None
    return list(root.glob("azq-fill-*"))


def test_a_fill_to_its_maximum_measures_each_fanout_and_puts_everything_back(daemon: object) -> None:
    version = _version()
    c = Client()
    pid = c.ping().pid
    before, host = _manager_state(pid, version), HostSnapshot.take()
    result = fill.run_fill(load(str(WORKLOAD)), ["agentzip"], 4096 * MIB, step=1, max_sandboxes=2, window_s=10.0,
                           slowdown=20.0, grace_s=0.5)
    r = result["policies"]["agentzip"]
    assert (r["filled"], r["stop_reason"]) == (2, "max-sandboxes"), r
    assert [p["sandboxes"] for p in r["points"]] == [1, 2]
    for p in r["points"]:
        assert p["passed"] and p["tool_calls"] > 0 and p["failed_steps"] == 0 and p["oom_kills"] == 0
        # The manager and the QEMUs allocate after they are moved in: the cgroup sees it.
        assert 4 * MIB < p["usage_bytes_avg"] <= p["usage_bytes_peak"] < 4096 * MIB
    assert r["points"][1]["usage_bytes_peak"] > r["points"][0]["usage_bytes_avg"]
    assert _manager_state(pid, version) == before
    assert _left_cgroups(version) == []
    assert c.list_sandboxes() == []
    assert HostSnapshot.take().diff(host) == []


def test_a_budget_too_small_stops_the_fill_and_the_manager_survives(daemon: object) -> None:
    version = _version()
    c = Client()
    pid = c.ping().pid
    before = _manager_state(pid, version)
    result = fill.run_fill(load(str(WORKLOAD)), ["none-cow"], 96 * MIB, step=1, max_sandboxes=4, window_s=20.0,
                           slowdown=20.0, grace_s=0.5)
    r = result["policies"]["none-cow"]
    # A TCG QEMU's own memory alone outgrows 96 MiB: its window fails (the kernel kills it,
    # or a tool call fails while it reclaims), and the fill stops there.
    assert r["stop_reason"] in ("oom", "sandbox-died", "step-failed", "over-budget"), r
    assert r["filled"] < 4 and not r["points"][-1]["passed"]
    assert c.ping().pid == pid                   # the OOM killer spared the manager
    assert _manager_state(pid, version) == before
    assert _left_cgroups(version) == []
    assert c.list_sandboxes() == []
