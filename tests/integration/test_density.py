"""The density benchmark at its small configuration, every policy, real sandboxes.

Checks that each policy's run completes, that the guest-visible results (every tool call's
exit code and output) are identical across policies, that the agentzip policies really
compressed, and that the host is left as it was found (no swap device, KSM as before).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from azqemu.bench import density
from azqemu.bench.workload import load
from azqemu.client import Client
from azqemu.host.linuxmm import HostSnapshot

# No uffd marker: without userfaultfd the agentzip policies restore eagerly (copy).
pytestmark = [pytest.mark.vm, pytest.mark.root]
WORKLOAD = Path(__file__).parent / "data" / "deterministic.yaml"
POLICIES = ["none", "none-cow", "linux", "agentzip", "agentzip-no-prefetch", "agentzip-no-sibling",
            "agentzip-pressure"]


def test_every_policy_runs_and_guest_results_are_identical(daemon: object) -> None:
    before = HostSnapshot.take()
    wl = load(str(WORKLOAD))
    # linux with its own grace (--policy-grace linux=1.0): the baseline tuned apart.
    result = density.run_density(wl, 2, POLICIES, grace_s=0.5, grace_by_policy={"linux": 1.0})
    assert set(result["policies"]) == set(POLICIES)
    assert {n: p["grace_s"] for n, p in result["policies"].items()} == {p: 1.0 if p == "linux" else 0.5
                                                                       for p in POLICIES}
    plan = wl.plan(2, 0)
    for name, pol in result["policies"].items():
        assert len(pol["steps"]) == sum(len(p) for p in plan), name
        assert pol["failed_steps"] == 0, (name, [s for s in pol["steps"] if s["exit_code"]])
        assert pol["owned_bytes_avg"] > 0 and pol["tool_latency_s"]["median"] > 0
        # The guests' vCPU threads ran the tool calls: part of the QEMUs' CPU, not all of it.
        assert 0 < pol["qemu_vcpu_user_s"] + pol["qemu_vcpu_sys_s"] <= pol["qemu_cpu_s"] + 0.05, name
    assert density.outputs_identical(result) == []
    # linux's zram holds what its two guests can swap, no more (its table costs per GiB).
    assert result["policies"]["linux"]["zram_disksize_bytes"] == 2 * (wl.template.mem_mib << 20)
    for name in ("agentzip", "agentzip-no-prefetch", "agentzip-no-sibling"):
        assert result["policies"][name]["compress_s_total"] > 0, name
        assert result["policies"][name]["owned_bytes_avg"] < result["policies"]["none"]["owned_bytes_avg"]
    # Nothing left behind: no sandbox, and the host's swap/KSM/zram settings as they were.
    assert Client().list_sandboxes() == []
    assert HostSnapshot.take().diff(before) == []
