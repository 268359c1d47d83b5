"""`azq bench capacity` end to end at its smallest: two fan-outs (1 and 2 sandboxes), the
copy-on-write baseline and agentzip, one workload; the JSON contract, finite host-cost fits
(host-wide, noisy at this size) and positive fits on the daemon's own accounting."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from azqemu.units import MIB

pytestmark = [pytest.mark.vm, pytest.mark.root]
POLICIES = ("none-cow", "agentzip")
# Its own small workload (and so its own template name: a template build domain's name is
# host-wide, and other integration tests build the template of data/deterministic.yaml). Each
# sandbox keeps 320 MiB of random data in tmpfs from its first step on, so that the slope
# (~320 MiB per sandbox under every policy: random data does not compress) stands out of the
# host-wide noise of a shared host (MemAvailable moves by hundreds of MiB there).
WORKLOAD = """
format: azq-workload/1
name: capacity-itest
template:
  mem_mib: 768
  warmup: ["cd /workspace/tally && python3 -m unittest -q"]
steps:
  - name: fill
    tool: "head -c 160M /dev/urandom > /dev/shm/r.bin && head -c 160M /dev/urandom > /tmp/r.bin && echo filled"
    wait_s: 3
  - {name: read, tool: "md5sum /workspace/tally/tally/*.py | sort", wait_s: 3}
  - {name: test, tool: "cd /workspace/tally && python3 -m unittest -q 2>&1 | tail -n 1", wait_s: 3}
  - {name: verify, tool: "wc -c < /tmp/r.bin; wc -c < /dev/shm/r.bin", wait_s: 2}
scales:
  small: {fanout: 2, max_steps: 4, wait_scale: 1.0}
"""


def test_capacity_sweep_json_contract(daemon: object, azq, tmp_path: Path) -> None:
    wl = tmp_path / "capacity-itest.yaml"
    wl.write_text(WORKLOAD)
    out = tmp_path / "out"
    r = azq("bench", "capacity", "--workload", str(wl), "--fanouts", "1,2", "--scale", "small",
            "--policy", POLICIES[0], "--policy", POLICIES[1], "--json", "--out", str(out), timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout)
    assert set(result) >= {"workload", "budget_bytes", "fanouts", "policies"}
    assert result["workload"] == "capacity-itest" and result["fanouts"] == [1, 2]
    assert isinstance(result["budget_bytes"], int) and result["budget_bytes"] > 0
    assert set(result["policies"]) == set(POLICIES)
    for name, pol in result["policies"].items():
        assert pol["failed_steps"] == 0, name
        # Host-wide figures: two fan-outs of one and two sandboxes are within what the host's
        # own churn moves (seen: a negative slope on a quiet CI host), so only their form is
        # checked; a slope that is not positive gives no fit (None), never a made-up count.
        for key in ("marginal_host_cost_bytes", "fixed_host_cost_bytes"):
            v = pol[key]
            assert isinstance(v, (int, float)) and math.isfinite(v), (name, key, v, pol["points"])
        for key in ("fit_host_cost", "fit_with_qemu"):
            assert pol[key] is None or (isinstance(pol[key], int) and pol[key] >= 0), (name, key, pol[key])
        if pol["marginal_host_cost_bytes"] > 0:
            assert pol["fit_with_qemu"] <= pol["fit_host_cost"]
        else:
            assert pol["fit_host_cost"] is None
        # The daemon's own accounting (not moved by other work on the host): each sandbox owns
        # most of its 320 MiB of random data.
        assert pol["marginal_accounted_bytes"] > 200 * MIB, (name, pol["points"])
        assert isinstance(pol["fit_accounted"], int) and pol["fit_accounted"] > 0
        assert set(pol["tool_latency_median_s"]) == {"1", "2"}
        assert all(math.isfinite(x) and x > 0 for x in pol["tool_latency_median_s"].values())
    for f in ("capacity.json", "capacity.md", "capacity.png", "density-n1.json", "density-n2.json"):
        assert (out / f).exists(), f
