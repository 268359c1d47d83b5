"""Kill -9 at every named crash point of compress, flush, free and compaction; reopen; every
page a simulated guest no longer holds decodes to its exact bytes (crashsim.py).

CRIU's and SQLite's way: the scenario runs in a subprocess with ``AZQ_CRASH_AT=<point>@<n>``
(azqemu/memory/crashpoint.py), which SIGKILLs itself the n-th time it reaches the point; the
test then reopens the store, checks every page of every guest against its truth, runs one
more compression on what was recovered, and reopens once more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from azqemu.memory.crashpoint import POINTS

from . import crashsim

REPO = Path(__file__).resolve().parents[3]
# n-th hit of each point to crash at: the first, one in the middle of the scenario, a late one.
HITS = {"after-encode": (1, 5, 8), "after-flush-snapshot": (1, 5, 9), "between-generation-files": (1, 4, 8),
        "after-commit": (1, 6, 8), "after-reclaim": (2, 7, 9), "after-flush": (1, 5, 8),
        "after-discard-batch": (1, 6, 15), "after-free-compact": (1,), "after-compact-copy": (1,),
        "after-compact-switch": (1,)}
TOTALS: dict[str, int] = {"crash_points_tried": 0, "kills": 0, "pages_verified": 0, "wrong_pages": 0,
                          "missing_pages": 0}


def _run(root: Path, crash_at: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != "AZQ_CRASH_AT"}
    if crash_at:
        env["AZQ_CRASH_AT"] = crash_at
    proc = subprocess.run([sys.executable, "-m", "tests.unit.memory.crashsim", str(root)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"scenario failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.returncode


def test_every_point_is_known() -> None:
    assert set(HITS) | {"after-commit", "after-reclaim"} == set(POINTS)


@pytest.mark.parametrize(("point", "nth"), [(p, n) for p, ns in HITS.items() for n in ns])
def test_kill_at_point_loses_no_page(tmp_path_factory: pytest.TempPathFactory, point: str, nth: int) -> None:
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") else None
    work = Path(tmp_path_factory.mktemp("crash")) if base is None else Path(
        subprocess.check_output(["mktemp", "-d", "-p", str(base), "azq-crash-XXXXXX"], text=True).strip())
    try:
        root = work / "store"
        rc = _run(root, f"{point}@{nth}")
        assert rc == -signal.SIGKILL, f"{point} was not reached {nth} time(s)"
        counts = crashsim.verify(root)
        assert counts["wrong_pages"] == 0, counts
        assert counts["missing_pages"] == 0, counts
        assert counts["pages_verified"] >= crashsim.N_PAGES * 3
        if rc == -signal.SIGKILL:
            assert any(p.name.startswith("guest-") for p in work.iterdir())
        # And once more, after the recovered store was used and closed.
        again = crashsim.verify(root)
        assert again["wrong_pages"] == 0 and again["missing_pages"] == 0
        TOTALS["crash_points_tried"] += 1
        TOTALS["kills"] += rc == -signal.SIGKILL
        for k in ("pages_verified", "wrong_pages", "missing_pages"):
            TOTALS[k] += counts[k] + again[k]
        print(f"\n{point}@{nth}: killed={rc == -signal.SIGKILL} {counts} totals={TOTALS}")
    finally:
        subprocess.run(["rm", "-rf", str(work)], check=False)


def test_scenario_without_a_crash(tmp_path: Path) -> None:
    root = tmp_path / "store"
    assert _run(root, None) == 0
    counts = crashsim.verify(root)
    assert counts["wrong_pages"] == 0 and counts["missing_pages"] == 0
    assert counts["dropped_pages"] > crashsim.N_PAGES       # the scenario did drop pages
