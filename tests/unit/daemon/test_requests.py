"""Requests checked at the door (azqemu.daemon.requests): every bad argument is one ConfigError."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.daemon.requests import CHECKS, check_args
from azqemu.errors import ConfigError
from azqemu.names import is_valid_name

BAD_NAMES = ["", "/", "..", ".", "base/", "../etc", "a/b", "-x", ".hidden", "x" * 65, "é", "ﬁle",
             "a b", "a\n", "a\0b", 7, None.__class__.__name__ + "/", ["x"], {"n": 1}]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_names_outside_the_alphabet_are_refused_for_every_name_argument(bad: object) -> None:
    for arg in ("name", "template", "sharing_domain"):
        with pytest.raises(ConfigError, match="^destroy: invalid "):
            check_args("destroy", {arg: bad})


def test_good_names_and_requests_pass() -> None:
    check_args("clone", {"template": "base", "count": 16, "name_prefix": "task-42.a_", "sharing_domain": "t1",
                         "policy": "agentzip", "grace_s": 1.0, "ram_mode": None})
    check_args("exec", {"name": "base-0", "argv": ["/bin/sh", "-c", "echo é"], "timeout_s": 300,
                        "kind": "run_tests"})
    check_args("set_policy", {"names": ["a", "b"], "policy": "linux", "grace_s": 0,
                              "pressure_budget_bytes": 1 << 30})
    check_args("template_create", {"name": "t", "mem_mib": 512, "vcpus": 1, "warmup": ["true"]})


@pytest.mark.parametrize("args, text", [
    ({"count": 0}, "count: expected an integer from 1 to 256"),
    ({"count": True}, "count: expected an integer"),
    ({"count": "3"}, "count: expected an integer"),
    ({"count": 10 ** 9}, "count: expected an integer"),
    ({"timeout_s": math.nan}, "timeout_s: expected a finite number"),
    ({"timeout_s": math.inf}, "timeout_s: expected a finite number"),
    ({"timeout_s": 0}, "timeout_s: expected a finite number of seconds above 0"),
    ({"grace_s": -1.0}, "grace_s: expected a finite number"),
    ({"prefetch": "yes"}, "prefetch: expected true or false"),
    ({"argv": []}, "argv: expected a non-empty list"),
    ({"argv": ["ls", 3]}, "argv: expected a non-empty list"),
    ({"argv": "ls"}, "argv: expected a non-empty list"),
    ({"names": "a"}, "names: expected a list"),
    ({"names": ["ok", "../x"]}, "invalid sandbox name '../x'"),
    ({"name_prefix": "a/"}, "invalid name prefix"),
    ({"name_prefix": "x" * 60}, "invalid name prefix"),
    ({"mem_mib": 1.5}, "mem_mib: expected an integer"),
    ({"kind": "bash/run"}, "invalid call kind 'bash/run'"),
])
def test_bad_values_are_one_clear_line(args: dict, text: str) -> None:
    with pytest.raises(ConfigError) as exc:
        check_args("op", args)
    assert text in str(exc.value) and "\n" not in str(exc.value)


@settings(deadline=None)  # the machine is shared: time is not what this test checks
@given(st.dictionaries(st.sampled_from(sorted(CHECKS)),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
                                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                                    max_leaves=8), max_size=4))
def test_any_json_value_is_accepted_or_refused_with_config_error(args: dict) -> None:
    try:
        check_args("op", args)
    except ConfigError as exc:
        assert "\n" not in str(exc)
        return
    # Accepted: every name argument that was given is a valid name.
    for arg in ("name", "template", "sharing_domain"):
        if args.get(arg) is not None:
            assert is_valid_name(args[arg])
