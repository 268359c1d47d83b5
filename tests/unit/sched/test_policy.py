"""The policies: what each one does in an LLM wait, and the table that documents them."""

from __future__ import annotations

import re

import pytest

from azqemu.errors import ConfigError
from azqemu.sched import policy


def test_unknown_policy_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as err:
        policy.get("zswap")
    assert str(err.value) == ("unknown policy 'zswap' (one of: manual, none, none-cow, linux, agentzip, "
                              "agentzip-no-prefetch, agentzip-no-sibling, agentzip-no-trim, agentzip-steady-trims, "
                              "agentzip-prefetch-first, agentzip-pressure)")


def test_each_policy_does_what_its_row_says() -> None:
    acts = {name: (p.clone_mode, p.compress_on_wait, p.linux_reclaim, p.pressure, p.prefetch, p.use_siblings,
                   p.trim_in_tool, p.trim_backoff, p.prefetch_beside)
            for name, p in policy.POLICIES.items()}
    assert acts == {
        "manual": ("lazy", False, False, False, True, True, False, True, True),
        "none": ("eager", False, False, False, True, True, False, True, True),
        "none-cow": ("cow", False, False, False, True, True, False, True, True),
        "linux": ("cow", False, True, False, True, True, False, True, True),
        "agentzip": ("cow", True, False, False, True, True, True, True, True),
        "agentzip-no-prefetch": ("cow", True, False, False, False, True, True, True, True),
        "agentzip-no-sibling": ("cow", True, False, False, True, False, True, True, True),
        "agentzip-no-trim": ("cow", True, False, False, True, True, False, True, True),
        "agentzip-steady-trims": ("cow", True, False, False, True, True, True, False, True),
        "agentzip-prefetch-first": ("cow", True, False, False, True, True, True, True, False),
        "agentzip-pressure": ("cow", False, False, True, False, True, False, True, True),
    }
    assert {n for n, p in policy.POLICIES.items() if p.compresses} == {
        "agentzip", "agentzip-no-prefetch", "agentzip-no-sibling", "agentzip-no-trim", "agentzip-steady-trims",
        "agentzip-prefetch-first", "agentzip-pressure"}


def test_the_documented_table_lists_every_policy_with_its_clone_mode() -> None:
    rows = re.findall(r"^\| ([^\s|]+)\s*\| ([^\s|]+)", policy.__doc__ or "", re.MULTILINE)
    documented = {name: mode for name, mode in rows if name != "policy"}
    assert set(documented) == set(policy.POLICIES)
    for name, mode in documented.items():
        # "lazy (or eager)": manual clones lazily where userfaultfd works
        assert mode in ("eager", "copy-on-write", "lazy")
        assert {"eager": "eager", "copy-on-write": "cow", "lazy": "lazy"}[mode] == policy.get(name).clone_mode


def _grace_options() -> dict[str, object]:
    """The --grace default of every command that takes one, by command path."""
    import click

    from azqemu.cli import cli

    found: dict[str, object] = {}

    def walk(cmd: click.Command, path: str, ctx: click.Context) -> None:
        for p in cmd.params:
            if p.name == "grace_s":
                found[path] = p.default
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                child = cmd.get_command(ctx, sub)
                if child is not None:
                    walk(child, f"{path} {sub}", click.Context(child, parent=ctx, info_name=sub))

    walk(cli, "azq", click.Context(cli, info_name="azq"))
    return found


def test_one_grace_default_wherever_a_user_meets_it() -> None:
    """The CLI's options, the API's models, a clone's record and the nightly all start from the
    scheduler's default: a second copy of the number drifted once (1.0 in nine places)."""
    from azqemu.api import models
    from azqemu.bench import nightly
    from azqemu.virt import clones

    options = _grace_options()
    assert {"azq clone", "azq bench density", "azq bench capacity", "azq bench fill",
            "azq bench nightly"} <= set(options)
    assert set(options.values()) == {policy.DEFAULT_GRACE_S}
    assert models.CloneRequest.model_fields["grace_s"].default == policy.DEFAULT_GRACE_S
    assert models.Sandbox.model_fields["grace_s"].default == policy.DEFAULT_GRACE_S
    assert clones.SandboxRecord.__dataclass_fields__["grace_s"].default == policy.DEFAULT_GRACE_S
    assert nightly.Options.__dataclass_fields__["grace_s"].default == policy.DEFAULT_GRACE_S
    # Below the shortest LLM answer, above the gaps between the tool calls of one turn.
    assert 0.1 <= policy.DEFAULT_GRACE_S < 1.0
