"""``azq bench nightly`` twice at its smallest: the history, comparability, plots, --json.

One built-in workload (random-data: no template warm-up), one sandbox, scale small, two
policies, clone and restore skipped: the second run must find the first as its one comparable
predecessor, which is not yet a baseline (two are needed), so it reports no regression.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.root]
GROUP = "density/random-data"
ARGS = ("bench", "nightly", "--workload", "random-data", "--scale", "small", "--sandboxes", "1",
        "--policy", "none-cow", "--policy", "agentzip", "--grace", "0.5", "--skip-clone", "--skip-restore",
        "--json")


@pytest.mark.timeout(420)
def test_two_tiny_nightlies(daemon: object, azq: Any, tmp_path: Path) -> None:
    results = tmp_path / "nightly"
    outs, errs = [], []
    for _ in range(2):
        r = azq(*ARGS, "--results", str(results), timeout=400)
        assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
        outs.append(json.loads(r.stdout))
        errs.append(r.stderr)
    first, second = outs

    # Comparability was decided before the run and said on stderr.
    assert first["baselines"][GROUP] == {"comparable_runs": 0, "baseline_runs": [], "status": "no baseline yet"}
    assert second["baselines"][GROUP]["comparable_runs"] == 1
    assert second["baselines"][GROUP]["status"] == "no baseline yet"
    assert "no baseline yet (1 comparable earlier run, 2 needed)" in errs[1]
    assert second["regressions"] == [] and second["errors"] == []
    assert {c["verdict"] for c in second["comparisons"]} <= {"no baseline"}

    # Both runs recorded, one line each, in order.
    lines = (results / "history.jsonl").read_text().splitlines()
    assert len(lines) == 2
    recs = [json.loads(line) for line in lines]
    assert [r["run_id"] for r in recs] == [first["record"]["run_id"], second["record"]["run_id"]]
    rec = recs[1]
    assert rec["format"] == "azq-nightly/1" and rec["accelerator"] in ("tcg", "kvm")
    assert rec["commit"] and rec["host"] and rec["kernel"]
    assert (rec["scale"], rec["seed"], rec["grace_s"], rec["sandboxes"]) == ("small", 0, 0.5, 1)
    assert rec["clone"] is None and rec["restore"] is None
    pols = rec["workloads"]["random-data"]["policies"]
    assert set(pols) == {"none-cow", "agentzip"}
    assert pols["agentzip"]["failed_steps"] == 0 and pols["agentzip"]["owned_bytes_avg"] > 0
    assert pols["agentzip"]["tool_median_s"] > 0 and pols["agentzip"]["slowdown_vs_none_cow"] is not None
    assert rec["workloads"]["random-data"]["digest"] == recs[0]["workloads"]["random-data"]["digest"]

    # Files: the density result, the trend plots, nightly.json (the same JSON as printed).
    run_dir = Path(second["run_dir"])
    assert (run_dir / "density-random-data.json").exists()
    plots = [Path(p) for p in second["plots"]]
    assert run_dir / "trend-density-random-data-host_cost_bytes_avg.png" in plots
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in plots)
    assert json.loads((run_dir / "nightly.json").read_text()) == second
