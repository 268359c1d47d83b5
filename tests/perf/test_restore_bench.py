"""``azq bench restore`` figures on this host (prints them, asserts no speed target).

Runs the command as a user would: against the running daemon (or one started for the run)
and the bench template in the default state directory (created on first use). Set
AZQ_BENCH_HOT_MIB to change the working set (default 100 MiB). The test fails when the
benchmark itself fails (non-zero exit, no JSON, faults its handler could not serve): a
benchmark that did not run has no figures to report. Run:

    .venv/bin/python -m pytest -s tests/perf/test_restore_bench.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from azqemu.bench.restore_bench import format_table

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]
HOT_MIB = int(os.environ.get("AZQ_BENCH_HOT_MIB", "100"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (libvirt qemu:///system, userfaultfd)")
def test_bench_restore_figures() -> None:
    from azqemu.host.doctor import restore_mode

    mode, why = restore_mode()
    if mode != "lazy":
        pytest.skip(f"no userfaultfd export here: {why}")
    r = subprocess.run([sys.executable, "-m", "azqemu", "bench", "restore", "--hot-mib", str(HOT_MIB), "--json"],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        pytest.fail(f"azq bench restore failed ({r.returncode}): {r.stderr.strip()}", pytrace=False)
    try:
        res = json.loads(r.stdout)
    except json.JSONDecodeError as err:
        pytest.fail(f"azq bench restore --json printed no JSON ({err}): {r.stdout[:500]!r}", pytrace=False)
    print()
    print(format_table(res))
    print(json.dumps(res, indent=2))
    assert res["handler_errors"] == 0, "the fault handler left faults unserved"
