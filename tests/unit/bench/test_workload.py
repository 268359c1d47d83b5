"""Workload files: format, validation errors, deterministic per-sandbox expansion, built-ins."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest

from azqemu.bench import workload as wlmod
from azqemu.bench.workload import ConfigError, Step, load, loads

REPO = Path(__file__).resolve().parents[3]

MINIMAL = """
format: azq-workload/1
name: t
steps:
  - tool: "echo {i} {rand_word} {rand_int:5-9} {rand_hex:4} {task_word} {who}"
    wait_s: [1, 2]
vars:
  who: [ann, bob]
"""


def test_minimal_file_and_defaults() -> None:
    wl = loads(MINIMAL)
    assert wl.template == wlmod.TemplateSpec(image="default", mem_mib=512, vcpus=1, warmup=())
    assert wl.fanout == 4
    plan = wl.plan(seed=1)
    assert len(plan) == 4 and all(len(p) == 1 for p in plan)
    s = plan[2][0]
    assert isinstance(s, Step) and 1 <= s.wait_s <= 2 and s.timeout_s == wlmod.DEFAULT_TIMEOUT_S
    words = s.tool.split()
    assert words[0] == "echo" and words[1] == "2" and words[2] in wlmod.WORDS
    assert 5 <= int(words[3]) <= 9 and len(words[4]) == 4 and words[5] in wlmod.WORDS
    assert words[6] in ("ann", "bob") and s.label == "echo"


def test_plan_is_deterministic_and_varies_per_sandbox() -> None:
    wl = load("coding-agent")
    a, b = wl.plan(8, seed=7), wl.plan(8, seed=7)
    assert a == b
    assert len({tuple(p) for p in a}) == 8                  # every sandbox its own trajectory
    assert wl.plan(8, seed=8) != a
    # Sandbox i's plan does not depend on the fan-out.
    assert wl.plan(3, seed=7) == a[:3]


def test_task_word_is_shared_rand_word_is_not() -> None:
    wl = loads(MINIMAL.replace('"echo {i} {rand_word} {rand_int:5-9} {rand_hex:4} {task_word} {who}"',
                               '"{task_word} {rand_word}"'))
    plan = wl.plan(50, seed=3)
    assert len({p[0].tool.split()[0] for p in plan}) == 1
    assert len({p[0].tool.split()[1] for p in plan}) > 5


def test_unknown_braces_pass_through() -> None:
    text = MINIMAL.replace('"echo {i} {rand_word} {rand_int:5-9} {rand_hex:4} {task_word} {who}"',
                           """"awk '{ print $1 }' f; python3 -c 'd = {k: 1}; print(f\\"{x:>3}\\")' {unknown}" """)
    tool = loads(text).plan(1)[0][0].tool
    assert tool == """awk '{ print $1 }' f; python3 -c 'd = {k: 1}; print(f"{x:>3}")' {unknown}"""


def test_probability_repeat_and_weights() -> None:
    wl = loads("""
format: azq-workload/1
name: t
steps:
  - repeat: [2, 4]
    steps:
      - {tool: a, wait_s: 1}
      - {tool: b, wait_s: 1, p: 0}
      - {tool: [c, d], weights: [1, 0], wait_s: 0}
  - repeat: 0
    steps: [{tool: never, wait_s: 1}]
""")
    for steps in wl.plan(20, seed=0):
        tools = [s.tool for s in steps]
        assert 2 <= tools.count("a") <= 4 and "b" not in tools and "d" not in tools and "never" not in tools
        assert tools.count("c") == tools.count("a")


def test_p_does_not_shift_later_draws() -> None:
    base = """
format: azq-workload/1
name: t
steps:
  - {tool: "x", wait_s: [0, 10], p: P}
  - {tool: "y {rand_int}", wait_s: [0, 10]}
"""
    with_x = loads(base.replace("P", "1")).plan(5, seed=1)
    without_x = loads(base.replace("P", "0")).plan(5, seed=1)
    assert [(s.tool, s.wait_s) for p in with_x for s in p[1:]] == \
        [(s.tool, s.wait_s) for p in without_x for s in p]


def test_small_scale() -> None:
    for name in wlmod.builtin_names():
        wl = load(name)
        small = wl.plan(seed=1, scale="small")
        full = wl.plan(seed=1)
        sc = wl.scale("small")
        assert len(small) == (sc.fanout or 2) and len(full) == wl.fanout
        assert all(len(p) <= (sc.max_steps or 99) for p in small)
        # The small scale is a shorter run with shorter waits (still long enough to compress in).
        assert sum(s.wait_s for s in small[0]) < sum(s.wait_s for s in full[0]) / 2
    # A file without scales still has a small one.
    default_small = loads(MINIMAL).plan(seed=0, scale="small")
    assert len(default_small) == 2 and default_small[0][0].wait_s <= 0.2
    with pytest.raises(ConfigError, match=r"^workload t has no scale 'huge' \(known: full, small\)$"):
        loads(MINIMAL).plan(scale="huge")


def test_builtins_load_and_describe_the_template() -> None:
    assert wlmod.builtin_names() == ["coding-agent", "data-processing", "long-lived-heap", "long-tools",
                                     "many-small-files", "random-data", "service-agent"]
    ca = load("coding-agent")
    assert ca.template.mem_mib == 512 and ca.template.warmup
    assert any("python3 -m unittest -q" in s.tool and f"cd {wlmod.WORKSPACE_DIR}" in s.tool
               for s in ca.plan(1)[0])
    assert any("/dev/urandom" in s.tool for s in load("random-data").plan(1)[0])


def test_workspace_project_exists_in_the_image_recipe() -> None:
    assert (REPO / "images" / "workspace" / wlmod.WORKSPACE_PROJECT / "tests").is_dir()


@pytest.mark.parametrize("name", ["coding-agent", "data-processing", "random-data"])
def test_builtin_commands_run_on_this_host(name: str, tmp_path: Path) -> None:
    """The commands work with Debian's coreutils and python3 (paths pointed at tmp_path)."""
    shutil.copytree(REPO / "images" / "workspace" / "tally", tmp_path / "tally")
    wl = load(name)
    v = dict(wl.vars)
    if "ws" in v:
        v["ws"] = str(tmp_path / "tally")
    if "dir" in v:
        v["dir"] = str(tmp_path / "data")
    wl = dataclasses.replace(wl, vars=v)
    scale = "full" if name == "coding-agent" else "small"
    for steps in wl.plan(2, seed=11, scale=scale):
        for s in steps:
            cmd = s.tool.replace(wlmod.WORKSPACE_DIR, str(tmp_path / "tally"))
            r = subprocess.run(["/bin/sh", "-c", cmd], capture_output=True, text=True, timeout=60)
            assert r.returncode == 0, (s.label, cmd, r.stdout[-500:], r.stderr[-500:])
            if "python3 -m unittest" in cmd:
                assert r.stdout.strip().endswith("OK") or r.stderr.strip().endswith("OK"), r.stderr


@pytest.mark.parametrize("text, message", [
    ("- a\n", "<string>: expected a YAML mapping at the top"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: 1}]\nstepz: 1\n",
     "<string>: unknown key(s) stepz (allowed: description, fanout, format, name, scales, steps, template, vars)"),
    ("name: t\nsteps: [{tool: a, wait_s: 1}]\n", "<string>: missing key(s) format"),
    ("format: azq-workload/2\nname: t\nsteps: [{tool: a, wait_s: 1}]\n",
     "<string>: format: expected 'azq-workload/1', got 'azq-workload/2'"),
    ("format: azq-workload/1\nname: Bad Name\nsteps: [{tool: a, wait_s: 1}]\n",
     "<string>: name: expected a lowercase name ([a-z0-9._-], up to 64), got 'Bad Name'"),
    ("format: azq-workload/1\nname: t\nsteps: []\n", "<string>: steps: expected a non-empty list of steps"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: soon}]\n",
     "<string>: steps[0].wait_s: expected a number in [0, 3600], got 'soon'"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: [5, 2]}]\n",
     "<string>: steps[0].wait_s: range [5, 2] is reversed"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: [1, 2, 3]}]\n",
     "<string>: steps[0].wait_s: expected a number or [lo, hi], got a list of 3"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: true}]\n",
     "<string>: steps[0].wait_s: expected a number in [0, 3600], got True"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: '', wait_s: 1}]\n",
     "<string>: steps[0].tool: expected a non-empty shell command, got ''"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: [], wait_s: 1}]\n",
     "<string>: steps[0].tool: expected a command or a non-empty list of alternatives, got []"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: 'x {rand_int:9-1}', wait_s: 1}]\n",
     "<string>: steps[0].tool: rand_int takes LO-HI, not '9-1'"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: [a, b], weights: [1], wait_s: 1}]\n",
     "<string>: steps[0].weights: expected 2 weights, one per alternative"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: 1, p: 2}]\n",
     "<string>: steps[0].p: expected a number in [0, 1], got 2"),
    ("format: azq-workload/1\nname: t\nsteps: [{repeat: 2, steps: [{tool: a}]}]\n",
     "<string>: steps[0].steps[0]: missing key(s) wait_s"),
    ("format: azq-workload/1\nname: t\nsteps: [{repeat: [1000, 1000], steps: [{repeat: 1000, steps: [{tool: a, wait_s: 0}]}]}]\n",
     "<string>: steps: expands to more than 10000 steps per sandbox"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: 1}]\nvars: {i: 3}\n",
     "<string>: vars.i: expected an identifier that is not a built-in placeholder"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: 1}]\ntemplate: {mem_mib: 1}\n",
     "<string>: template.mem_mib: expected an integer in [64, 1048576], got 1"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: 1}]\nscales: {small: {fanout: 0}}\n",
     "<string>: scales.small.fanout: expected an integer in [1, 4096], got 0"),
    ("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: 1}\n",
     "<string>: not valid YAML at line 4: expected ',' or ']', but got '<stream end>'"),
])
def test_bad_files_are_refused_with_one_line(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        loads(text)
    assert str(exc.value) == message
    assert "\n" not in str(exc.value)


def test_deep_nesting_is_refused() -> None:
    inner = "{tool: a, wait_s: 0}"
    for _ in range(10):
        inner = "{repeat: 1, steps: [" + inner + "]}"
    with pytest.raises(ConfigError, match=r"nested deeper than 8$"):
        loads(f"format: azq-workload/1\nname: t\nsteps: [{inner}]\n")


def test_missing_file_names_the_builtins(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^no workload file .*nope.yaml \(built-in workloads: coding-agent, "):
        load(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"^no workload file nope "):
        load("nope")


def test_file_path_is_in_the_error(tmp_path: Path) -> None:
    p = tmp_path / "w.yaml"
    p.write_text("format: azq-workload/1\nname: t\nsteps: [{tool: a, wait_s: -1}]\n")
    with pytest.raises(ConfigError) as exc:
        load(p)
    assert str(exc.value) == f"{p}: steps[0].wait_s: expected a number in [0, 3600], got -1"


def test_plan_to_json_round_trips() -> None:
    plan = load("random-data").plan(2, seed=1, scale="small")
    js = wlmod.plan_to_json(plan)
    assert [[Step(**d) for d in p] for p in js] == plan


def test_sandbox_count_is_bounded() -> None:
    with pytest.raises(ConfigError, match="sandboxes must be 1-4096, not 0"):
        loads(MINIMAL).plan(0)
