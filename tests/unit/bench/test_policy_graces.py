"""Each policy's grace in a density run (``--policy-grace POLICY=SECONDS``): parsing, the
checks that refuse bad input before anything runs (the report's note: test_report.py)."""

from __future__ import annotations

import pytest

from azqemu.bench.density import parse_policy_graces, run_density
from azqemu.bench.workload import load
from azqemu.errors import ConfigError

RUN = ["none-cow", "linux", "agentzip"]


def test_items_become_a_grace_per_policy() -> None:
    assert parse_policy_graces(["linux=1.0", " agentzip =0"], RUN) == {"linux": 1.0, "agentzip": 0.0}
    assert parse_policy_graces([], RUN) == {}


@pytest.mark.parametrize(("item", "message"), [
    ("linux", "policy grace 'linux': expected POLICY=SECONDS (for example linux=1.0)"),
    ("=1.0", "policy grace '=1.0': expected POLICY=SECONDS (for example linux=1.0)"),
    ("linux=soon", "policy grace 'linux=soon': the grace must be a number of seconds >= 0"),
    ("linux=-1", "policy grace 'linux=-1': the grace must be a number of seconds >= 0"),
    ("linux=nan", "policy grace 'linux=nan': the grace must be a number of seconds >= 0"),
    ("linux=inf", "policy grace 'linux=inf': the grace must be a number of seconds >= 0"),
    ("zswap=1", "unknown policy 'zswap'"),
    ("none=1", "a grace is given for none, which this run does not run"),
])
def test_bad_items_are_one_clear_error(item: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_policy_graces([item], RUN)
    assert str(err.value).startswith(message)


def test_a_policy_given_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"policy grace 'linux=2': linux is given a grace twice"):
        parse_policy_graces(["linux=1", "linux=2"], RUN)


def test_a_run_refuses_a_grace_for_a_policy_it_does_not_run_before_it_starts() -> None:
    # Refused before any client call: this unit test has no daemon to reach.
    with pytest.raises(ConfigError, match="a grace is given for linux, which this run does not run"):
        run_density(load("coding-agent"), 2, ["none-cow", "agentzip"], grace_by_policy={"linux": 1.0})

