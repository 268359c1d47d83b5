"""Benchmark workloads: a YAML file of agent steps, expanded per sandbox from a seed.

A workload describes what every sandbox of a fan-out does: a template (image, memory, vCPUs,
warm-up commands), how many sandboxes by default, and a tree of steps, each a tool call (a
shell command run in the guest) followed by the LLM wait that comes after it. Commands are
templated ({i}, {rand_word}, variables), steps can be random choices, optional or repeated,
and waits can be ranges, so the N sandboxes run related but different trajectories, as the
sandboxes of one agent task do. Expansion is deterministic given (workload, seed, sandbox
index), so a benchmark run can be repeated exactly and compared across policies.

The format is documented in docs/workloads.md; the built-in workloads are files of that
format in azqemu/bench/workloads/. A bad file is refused with one ConfigError line that names
the file and the field.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from azqemu.errors import ConfigError

FORMAT = "azq-workload/1"
BUILTIN_DIR = Path(__file__).resolve().parent / "workloads"
# The guest image's workspace project (images/workspace/tally, copied to /workspace/tally
# at boot); the coding-agent workload works on it. Keep in step with images/workspace/.
WORKSPACE_PROJECT = "tally"
WORKSPACE_DIR = f"/workspace/{WORKSPACE_PROJECT}"

# Bounds that refuse an absurd file before it costs anything.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 8                 # nesting of repeat blocks
MAX_STEPS_PER_SANDBOX = 10_000
MAX_FANOUT = 4096
MAX_WAIT_S = 3600.0
MAX_COMMAND_CHARS = 16_384
DEFAULT_TIMEOUT_S = 300.0
# What scale="small" means for a file that does not define it: enough to exercise every
# mechanism in a demo or an integration test, in seconds rather than minutes.
DEFAULT_SMALL_FANOUT, DEFAULT_SMALL_MAX_STEPS, DEFAULT_SMALL_WAIT_SCALE, DEFAULT_SMALL_REPEAT_MAX = 2, 4, 0.1, 1

WORDS = (
    "alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo",
    "juniper", "kestrel", "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven",
    "sierra", "tundra", "umber", "velvet", "willow", "xenon", "yarrow", "zephyr",
)
BUILTIN_PLACEHOLDERS = ("i", "n", "seed", "step", "task_word", "rand_word", "rand_int", "rand_hex")
PLACEHOLDER_RE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([^{}]*))?\}")
RAND_INT_ARG_RE = re.compile(r"^(-?\d+)-(-?\d+)$")


@dataclass(frozen=True)
class Step:
    """One tool call and the LLM wait after it, as one sandbox runs it."""

    tool: str                 # shell command, run in the guest with /bin/sh -c
    wait_s: float             # the LLM "thinks" this long after the tool call returns
    timeout_s: float = DEFAULT_TIMEOUT_S
    label: str = ""           # a short name for reports (the step's `name`, or the command's first word)


@dataclass(frozen=True)
class TemplateSpec:
    image: str = "default"
    mem_mib: int = 512
    vcpus: int = 1
    warmup: tuple[str, ...] = ()


@dataclass(frozen=True)
class Scale:
    fanout: int | None = None
    max_steps: int | None = None
    wait_scale: float = 1.0
    repeat_max: int | None = None


@dataclass(frozen=True)
class _StepNode:
    tools: tuple[str, ...]
    weights: tuple[float, ...] | None
    wait: tuple[float, float]
    p: float
    timeout_s: float
    name: str


@dataclass(frozen=True)
class _Block:
    repeat: tuple[int, int]
    body: tuple[_StepNode | _Block, ...]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    template: TemplateSpec
    fanout: int
    vars: dict[str, Any]
    steps: tuple[_StepNode | _Block, ...]
    scales: dict[str, Scale] = field(default_factory=dict)
    source: str = ""

    def plan(self, sandboxes: int | None = None, seed: int = 0, scale: str = "full") -> list[list[Step]]:
        """The concrete steps of each sandbox: ``plan(...)[i]`` is sandbox i's list.

        ``sandboxes`` defaults to the scale's fan-out. Deterministic in (workload, seed, index,
        scale): sandbox i's steps do not depend on how many sandboxes there are.
        """
        sc = self.scale(scale)
        n = sandboxes if sandboxes is not None else (sc.fanout or self.fanout)
        if not 1 <= n <= MAX_FANOUT:
            raise ConfigError(f"workload {self.name}: sandboxes must be 1-{MAX_FANOUT}, not {n}")
        task_rng = random.Random(_seed_int(self.name, seed, "task"))
        task_word = task_rng.choice(self.vars.get("words") or WORDS)
        return [self._expand(i, n, seed, sc, task_word) for i in range(n)]

    def scale(self, name: str) -> Scale:
        if name == "full":
            return Scale()
        if name in self.scales:
            return self.scales[name]
        if name == "small":
            return Scale(fanout=DEFAULT_SMALL_FANOUT, max_steps=DEFAULT_SMALL_MAX_STEPS,
                         wait_scale=DEFAULT_SMALL_WAIT_SCALE, repeat_max=DEFAULT_SMALL_REPEAT_MAX)
        raise ConfigError(f"workload {self.name} has no scale {name!r} "
                          f"(known: full, {', '.join(sorted(set(self.scales) | {'small'}))})")

    def _expand(self, i: int, n: int, seed: int, sc: Scale, task_word: str) -> list[Step]:
        rng = random.Random(_seed_int(self.name, seed, i))
        out: list[Step] = []
        limit = sc.max_steps if sc.max_steps is not None else MAX_STEPS_PER_SANDBOX

        def walk(nodes: tuple[_StepNode | _Block, ...]) -> None:
            for node in nodes:
                if len(out) >= limit:
                    return
                if isinstance(node, _Block):
                    count = rng.randint(*node.repeat)
                    if sc.repeat_max is not None:
                        count = min(count, sc.repeat_max)
                    for _ in range(count):
                        walk(node.body)
                    continue
                # Draw everything for a step even when it is skipped, so that p only removes
                # this step and does not shift every later draw.
                keep = rng.random() < node.p
                tool = (rng.choices(node.tools, weights=node.weights)[0] if node.weights
                        else rng.choice(node.tools))
                wait = rng.uniform(*node.wait) if node.wait[0] != node.wait[1] else node.wait[0]
                if not keep:
                    continue
                ctx = {"i": i, "n": n, "seed": seed, "step": len(out), "task_word": task_word}
                cmd = substitute(tool, ctx, self.vars, rng)
                label = node.name or cmd.split(None, 1)[0]
                out.append(Step(tool=cmd, wait_s=round(wait * sc.wait_scale, 3), timeout_s=node.timeout_s,
                                label=label))

        walk(self.steps)
        return out


def _seed_int(name: str, seed: int, what: object) -> int:
    # Not hash(): str hashing is randomised per process; a plan must not be.
    return int.from_bytes(hashlib.sha256(f"{name}\0{seed}\0{what}".encode()).digest()[:8], "little")


def substitute(text: str, ctx: dict[str, Any], variables: dict[str, Any], rng: random.Random,
               depth: int = 0) -> str:
    """Fill the placeholders of one command. Unknown names stay literal (shell and Python
    braces such as awk's ``{print $1}`` or an f-string's ``{x}`` pass through untouched)."""

    def one(m: re.Match[str]) -> str:
        name, arg = m.group(1), m.group(2)
        if name in ctx and arg is None:
            return str(ctx[name])
        if name == "rand_word" and arg is None:
            return rng.choice(variables.get("words") or WORDS)
        if name == "rand_int":
            lo, hi = (0, 999_999) if arg is None else _rand_int_range(arg)
            return str(rng.randint(lo, hi))
        if name == "rand_hex":
            nchars = 8 if arg is None else int(arg)
            return "".join(rng.choice("0123456789abcdef") for _ in range(nchars))
        if name in variables and arg is None:
            value = variables[name]
            if isinstance(value, list):
                value = rng.choice(value)
            value = str(value)
            return substitute(value, ctx, variables, rng, depth + 1) if depth < 4 else value
        return m.group(0)

    return PLACEHOLDER_RE.sub(one, text)


def _rand_int_range(arg: str) -> tuple[int, int]:
    m = RAND_INT_ARG_RE.match(arg)
    if not m or int(m.group(1)) > int(m.group(2)):
        raise ValueError(f"rand_int takes LO-HI, not {arg!r}")
    return int(m.group(1)), int(m.group(2))


# ---------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------

class _Bad(Exception):
    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}" if where else what)


def _num(v: Any, where: str, lo: float, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _Bad(where, f"expected a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _Bad(where, f"expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _range(v: Any, where: str, lo: float, hi: float) -> tuple[float, float]:
    if isinstance(v, list):
        if len(v) != 2:
            raise _Bad(where, f"expected a number or [lo, hi], got a list of {len(v)}")
        a, b = _num(v[0], where, lo, hi), _num(v[1], where, lo, hi)
        if a > b:
            raise _Bad(where, f"range [{v[0]}, {v[1]}] is reversed")
        return a, b
    x = _num(v, where, lo, hi)
    return x, x


def _int_range(v: Any, where: str, lo: int, hi: int) -> tuple[int, int]:
    if isinstance(v, list):
        if len(v) != 2:
            raise _Bad(where, f"expected an integer or [lo, hi], got a list of {len(v)}")
        a, b = _int(v[0], where, lo, hi), _int(v[1], where, lo, hi)
        if a > b:
            raise _Bad(where, f"range [{v[0]}, {v[1]}] is reversed")
        return a, b
    x = _int(v, where, lo, hi)
    return x, x


def _keys(d: dict[str, Any], where: str, allowed: set[str],
          required: frozenset[str] | set[str] = frozenset()) -> None:
    unknown = set(d) - allowed
    if unknown:
        raise _Bad(where, f"unknown key(s) {', '.join(sorted(map(str, unknown)))} "
                          f"(allowed: {', '.join(sorted(allowed))})")
    missing = required - set(d)
    if missing:
        raise _Bad(where, f"missing key(s) {', '.join(sorted(missing))}")


def _command(v: Any, where: str, variables: dict[str, Any]) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _Bad(where, f"expected a non-empty shell command, got {v!r}")
    if len(v) > MAX_COMMAND_CHARS:
        raise _Bad(where, f"command longer than {MAX_COMMAND_CHARS} characters")
    for m in PLACEHOLDER_RE.finditer(v):
        name, arg = m.group(1), m.group(2)
        if name == "rand_int" and arg is not None:
            try:
                _rand_int_range(arg)
            except ValueError as err:
                raise _Bad(where, str(err)) from None
        if name == "rand_hex" and arg is not None and not (arg.isdigit() and 1 <= int(arg) <= 64):
            raise _Bad(where, f"rand_hex takes a length of 1-64, not {arg!r}")
    return v


def _parse_nodes(items: Any, where: str, variables: dict[str, Any], depth: int) -> tuple[_StepNode | _Block, ...]:
    if depth > MAX_DEPTH:
        raise _Bad(where, f"repeat blocks nested deeper than {MAX_DEPTH}")
    if not isinstance(items, list) or not items:
        raise _Bad(where, "expected a non-empty list of steps")
    nodes: list[_StepNode | _Block] = []
    for k, item in enumerate(items):
        w = f"{where}[{k}]"
        if not isinstance(item, dict):
            raise _Bad(w, f"expected a mapping with 'tool' or 'repeat', got {item!r}")
        if "repeat" in item:
            _keys(item, w, {"repeat", "steps"}, {"repeat", "steps"})
            rep = _int_range(item["repeat"], f"{w}.repeat", 0, 1000)
            nodes.append(_Block(repeat=rep, body=_parse_nodes(item["steps"], f"{w}.steps", variables, depth + 1)))
            continue
        _keys(item, w, {"tool", "wait_s", "p", "timeout_s", "name", "weights"}, {"tool", "wait_s"})
        tool = item["tool"]
        weights = None
        if isinstance(tool, str):
            tools: tuple[str, ...] = (_command(tool, f"{w}.tool", variables),)
        elif isinstance(tool, list) and tool:
            tools = tuple(_command(t, f"{w}.tool[{j}]", variables) for j, t in enumerate(tool))
        else:
            raise _Bad(f"{w}.tool", f"expected a command or a non-empty list of alternatives, got {tool!r}")
        if "weights" in item:
            ws = item["weights"]
            if not isinstance(ws, list) or len(ws) != len(tools):
                raise _Bad(f"{w}.weights", f"expected {len(tools)} weights, one per alternative")
            weights = tuple(_num(x, f"{w}.weights", 0, 1e6) for x in ws)
            if not sum(weights) > 0:
                raise _Bad(f"{w}.weights", "weights must not all be zero")
        name = item.get("name", "")
        if not isinstance(name, str) or len(name) > 64:
            raise _Bad(f"{w}.name", "expected a short string")
        nodes.append(_StepNode(
            tools=tools, weights=weights,
            wait=_range(item["wait_s"], f"{w}.wait_s", 0, MAX_WAIT_S),
            p=_num(item.get("p", 1.0), f"{w}.p", 0, 1),
            timeout_s=_num(item.get("timeout_s", DEFAULT_TIMEOUT_S), f"{w}.timeout_s", 0.1, 86400),
            name=name))
    return tuple(nodes)


def _max_steps(nodes: tuple[_StepNode | _Block, ...]) -> int:
    total = 0
    for node in nodes:
        total += node.repeat[1] * _max_steps(node.body) if isinstance(node, _Block) else 1
        if total > MAX_STEPS_PER_SANDBOX:
            return total
    return total


def _parse(doc: Any, source: str) -> Workload:
    if not isinstance(doc, dict):
        raise _Bad("", "expected a YAML mapping at the top")
    _keys(doc, "", {"format", "name", "description", "template", "fanout", "vars", "steps", "scales"},
          {"format", "name", "steps"})
    if doc["format"] != FORMAT:
        raise _Bad("format", f"expected {FORMAT!r}, got {doc['format']!r}")
    name = doc["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9][a-z0-9._-]{0,63}", name):
        raise _Bad("name", f"expected a lowercase name ([a-z0-9._-], up to 64), got {name!r}")
    desc = doc.get("description", "")
    if not isinstance(desc, str):
        raise _Bad("description", "expected a string")

    tpl = doc.get("template") or {}
    if not isinstance(tpl, dict):
        raise _Bad("template", "expected a mapping")
    _keys(tpl, "template", {"image", "mem_mib", "vcpus", "warmup"})
    warmup = tpl.get("warmup") or []
    if not isinstance(warmup, list):
        raise _Bad("template.warmup", "expected a list of commands")
    image = tpl.get("image", "default")
    if not isinstance(image, str) or not image:
        raise _Bad("template.image", f"expected an image name, got {image!r}")

    variables = doc.get("vars") or {}
    if not isinstance(variables, dict):
        raise _Bad("vars", "expected a mapping")
    for k, v in variables.items():
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or k in BUILTIN_PLACEHOLDERS:
            raise _Bad(f"vars.{k}", "expected an identifier that is not a built-in placeholder")
        vals = v if isinstance(v, list) else [v]
        if not vals or not all(isinstance(x, (str, int, float)) and not isinstance(x, bool) for x in vals):
            raise _Bad(f"vars.{k}", "expected a string, a number or a non-empty list of them")
    template = TemplateSpec(
        image=image,
        mem_mib=int(_int(tpl.get("mem_mib", 512), "template.mem_mib", 64, 1 << 20)),
        vcpus=int(_int(tpl.get("vcpus", 1), "template.vcpus", 1, 256)),
        warmup=tuple(_command(c, f"template.warmup[{j}]", variables) for j, c in enumerate(warmup)))

    steps = _parse_nodes(doc["steps"], "steps", variables, 0)
    if _max_steps(steps) > MAX_STEPS_PER_SANDBOX:
        raise _Bad("steps", f"expands to more than {MAX_STEPS_PER_SANDBOX} steps per sandbox")

    scales: dict[str, Scale] = {}
    raw_scales = doc.get("scales") or {}
    if not isinstance(raw_scales, dict):
        raise _Bad("scales", "expected a mapping of scale name to overrides")
    for sname, sc in raw_scales.items():
        w = f"scales.{sname}"
        if not isinstance(sc, dict) or sname == "full":
            raise _Bad(w, "expected a mapping of overrides (and 'full' is the file itself)")
        _keys(sc, w, {"fanout", "max_steps", "wait_scale", "repeat_max"})
        scales[str(sname)] = Scale(
            fanout=_int(sc["fanout"], f"{w}.fanout", 1, MAX_FANOUT) if "fanout" in sc else None,
            max_steps=_int(sc["max_steps"], f"{w}.max_steps", 1, MAX_STEPS_PER_SANDBOX) if "max_steps" in sc else None,
            wait_scale=_num(sc.get("wait_scale", 1.0), f"{w}.wait_scale", 0, 100),
            repeat_max=_int(sc["repeat_max"], f"{w}.repeat_max", 0, 1000) if "repeat_max" in sc else None)

    return Workload(name=name, description=desc.strip(), template=template,
                    fanout=_int(doc.get("fanout", 4), "fanout", 1, MAX_FANOUT),
                    vars=dict(variables), steps=steps, scales=scales, source=source)


def loads(text: str, source: str = "<string>") -> Workload:
    """Parse a workload from YAML text; ConfigError names the source and the field."""
    if len(text) > MAX_FILE_BYTES:
        raise ConfigError(f"{source}: workload file larger than {MAX_FILE_BYTES >> 10} KiB")
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from err
    try:
        return _parse(doc, source)
    except _Bad as err:
        raise ConfigError(f"{source}: {err}") from None


def load(path_or_name: str | Path) -> Workload:
    """Load a workload file, or a built-in workload by name (``coding-agent``)."""
    p = Path(path_or_name)
    if not p.suffix and not p.exists() and (BUILTIN_DIR / f"{p.name}.yaml").exists():
        p = BUILTIN_DIR / f"{p.name}.yaml"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"no workload file {p} (built-in workloads: {', '.join(builtin_names())})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read workload file {p}: {err}") from err
    return loads(text, str(p))


def builtin_names() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.yaml"))


def plan_to_json(plan: list[list[Step]]) -> list[list[dict[str, Any]]]:
    """A plan as JSON-ready lists (for result files and for reproducing a run)."""
    return [[{"tool": s.tool, "wait_s": s.wait_s, "timeout_s": s.timeout_s, "label": s.label} for s in steps]
            for steps in plan]
