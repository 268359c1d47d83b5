"""The density benchmark: the same agent workload under each memory policy, one after the
other on the same host, in one invocation.

For each policy: clone the sandboxes (the policy picks full-copy, copy-on-write or lazy
clones), let the Linux configuration settle where it applies (KSM converged), then play the
workload plan: every sandbox runs its steps in its own thread, each step a tool call through
``azq exec`` (its latency as the orchestrator sees it, resume and prefetch included) followed
by an explicit "wait" hint and the LLM wait. A sampler records, every ``SAMPLE_S``, the host's
memory in use above the idle baseline (MemTotal - MemAvailable: nothing hidden, the store,
zram and the manager included) and every sandbox's owned bytes as the daemon accounts them
(``Manager.owned``). Afterwards the sandboxes are destroyed and the host is put back (the
Linux configuration's teardown: swapoff, zram reset, KSM restored).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from azqemu.bench import hostcpu, hostmem, rounds, toolcalls
from azqemu.bench.workload import Step, Workload
from azqemu.client import Client
from azqemu.errors import AzqemuError, ConfigError
from azqemu.host import memacct, procfs
from azqemu.host.linuxmm import signals_raise
from azqemu.host.threads import os_named
from azqemu.image import find_image
from azqemu.sched import policy as policy_mod

log = logging.getLogger(__name__)

# Sandboxes of the density benchmark are named azq-d-<policy>-N: a run destroys what an
# earlier run that was killed left under this prefix (nothing else uses it).
BENCH_PREFIX = "azq-d-"
SAMPLE_S = 1.0  # the sampler runs beside the workload: sample at 1 Hz, not faster
KSM_CONVERGE_TIMEOUT_S = 90.0
DEFAULT_POLICIES = ("none", "none-cow", "linux", "agentzip")


@dataclass
class StepResult:
    sandbox: int
    step: int
    label: str
    exit_code: int
    latency_s: float
    output_sha: str
    resume_s: float = 0.0
    prefetched_pages: int = 0
    error: str = ""
    lock_wait_s: float = 0.0       # the manager's parts of the call (toolcalls.py)
    trim_paused_s: float = 0.0
    faults: int = 0
    faults_from_store: int = 0


@dataclass
class PolicyRun:
    policy: str
    series: dict[str, list[float]] = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class _Sampler:
    """Samples host memory and the sandboxes' owned bytes in a thread."""

    def __init__(self, client: Client, names: list[str], baseline: hostmem.Baseline) -> None:
        self.c, self.names, self.base = client, names, baseline.used_bytes
        self.base_parts = baseline.parts_bytes
        self.parts: dict[str, list[float]] = {part: [] for part in hostmem.HOST_PARTS}
        self.t_s: list[float] = []
        self.owned: list[float] = []
        self.host_used: list[float] = []
        self.store: list[float] = []
        self.store_live: list[float] = []      # of which payloads still referenced
        self.zram: list[float] = []
        self.manager_rss: list[float] = []
        self.manager_anon: list[float] = []
        self.qemu_own: list[float] = []
        self.host_cost: list[float] = []
        self.per_sandbox: dict[str, list[float]] = {n: [] for n in names}
        self.last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=os_named(self._run), name="azq-density-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> None:
        r = self.c.owned(self.names).as_json()
        host = procfs.read_meminfo()
        zram = memacct.read_zram_total()
        rows = r["sandboxes"]
        self.t_s.append(time.monotonic() - self._t0)
        self.owned.append(float(sum(rows[n].get("owned_bytes", 0) for n in self.names)))
        qemu_own = float(sum(rows[n].get("qemu_own_bytes", 0) for n in self.names))
        self.qemu_own.append(qemu_own)
        for n in self.names:
            self.per_sandbox[n].append(float(rows[n].get("owned_bytes", 0)))
        used = host["MemTotal"] - host["MemAvailable"]
        self.host_used.append(float(used - self.base))
        self.host_cost.append(float(used - self.base) - qemu_own)
        for part, v in hostmem.host_parts(host).items():
            self.parts[part].append(float(v - self.base_parts.get(part, 0)))
        self.store.append(float(r["store_bytes"]))
        self.store_live.append(float(r.get("store_live_bytes", 0)))
        self.zram.append(float(zram.get("mem_used_total", 0)))
        self.manager_rss.append(float(r["manager_rss_bytes"]))
        self.manager_anon.append(float(r.get("manager_memory", {}).get("anon_bytes", 0)))
        self.last = rows

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except AzqemuError as exc:
                log.debug("sample failed: %s", exc)
            self._stop.wait(SAMPLE_S)


def _twa(t: list[float], y: list[float]) -> float:
    """Time-weighted average of a sampled series."""
    if not y:
        return float("nan")
    if len(y) == 1:
        return float(y[0])
    ta, ya = np.asarray(t), np.asarray(y)
    return float(np.sum((ya[1:] + ya[:-1]) * np.diff(ta)) / 2 / (ta[-1] - ta[0]))


def _run_plan(c: Client, names: list[str], plan: list[list[Step]],
              progress: Callable[[str], None]) -> list[StepResult]:
    """Play every sandbox's steps in its own thread. Ctrl-C (or SIGTERM, made SystemExit by
    the caller) stops the sandboxes' threads at their next step or wait and returns at once:
    the caller then destroys the sandboxes, which ends the tool calls still running."""
    results: list[StepResult] = []
    lock = threading.Lock()
    stop = threading.Event()

    def one(i: int) -> None:
        name = names[i]
        for k, step in enumerate(plan[i]):
            if stop.is_set():
                return
            t0 = time.monotonic()
            try:
                r = c.exec(name, ["/bin/sh", "-c", step.tool], timeout_s=step.timeout_s).as_json()
            except AzqemuError as exc:
                # Recorded as a failed step (the summary counts them), the run goes on.
                progress(f"  sandbox {i} step {k} failed: {exc}")
                r = {"exit_code": -1, "stdout_b64": "", "error": str(exc)}
            latency = time.monotonic() - t0
            out = comparable_output(base64.b64decode(r["stdout_b64"]))
            with lock:
                results.append(StepResult(i, k, step.label, r["exit_code"], latency,
                                          hashlib.sha256(out).hexdigest()[:16], r.get("resume_s", 0.0),
                                          r.get("prefetched_pages", 0), r.get("error", ""),
                                          r.get("lock_wait_s", 0.0), r.get("trim_paused_s", 0.0),
                                          r.get("faults", 0), r.get("faults_from_store", 0)))
            # The orchestrator now waits for its LLM: say so (the strongest phase source).
            c.phase(name, "wait")
            if stop.wait(step.wait_s):
                return
        progress(f"  sandbox {i} done ({len(plan[i])} steps)")

    pool = ThreadPoolExecutor(max_workers=len(names), thread_name_prefix="azq-density")
    try:
        for f in [pool.submit(one, i) for i in range(len(names))]:
            f.result()
    except BaseException:
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return sorted(results, key=lambda s: (s.sandbox, s.step))


def _manager_memory(c: Client) -> dict[str, int]:
    """The manager's RSS and its own (anonymous) memory, as the daemon reports them."""
    r = c.owned([]).as_json()
    return {"rss_bytes": int(r["manager_rss_bytes"]), "anon_bytes": int(r.get("manager_memory", {}).get("anon_bytes", 0))}


def run_policy(c: Client, template: str, wl: Workload, plan: list[list[Step]], policy: str, *,
               grace_s: float, progress: Callable[[str], None], pressure_budget_bytes: int | None,
               manager_idle: dict[str, int] | None = None) -> PolicyRun:
    """One policy's run; ``manager_idle`` is the manager before the whole density run (its
    memory above that is the manager's cost; default: measured before this policy)."""
    pol = policy_mod.get(policy)
    n = len(plan)
    run = PolicyRun(policy)
    with ExitStack() as stack:
        baseline = hostmem.idle_baseline(duration_s=2.0)
        at_start = _manager_memory(c)
        idle = manager_idle or at_start
        run.extra.update(manager_idle_rss_bytes=idle["rss_bytes"], manager_idle_anon_bytes=idle["anon_bytes"],
                         manager_anon_at_start_bytes=at_start["anon_bytes"], grace_s=grace_s)
        if pol.linux_reclaim:
            from azqemu.host.linuxmm import LinuxConfig, wait_ksm_converged, zram_disksize_for

            zram_bytes = zram_disksize_for(n * (wl.template.mem_mib << 20))
            lc = stack.enter_context(LinuxConfig(zram_disksize_bytes=zram_bytes))
            run.extra.update(zram_algorithm=lc.algorithm, zram_disksize_bytes=zram_bytes)
        progress(f"[{policy}] cloning {n} sandboxes ({pol.clone_mode})")
        t0 = time.monotonic()
        prefix = f"{BENCH_PREFIX}{policy_short(policy)}-"
        # Registered before the clone call: an interrupt while the daemon clones leaves
        # sandboxes the reply never named; they are found by their prefix.
        stack.callback(destroy_prefixed, c, prefix)
        rows = c.clone(template, count=n, name_prefix=prefix, policy=policy, grace_s=grace_s,
                       sharing_domain="bench")
        names = [r.name for r in rows]
        stack.callback(destroy_all, c, names)
        run.extra["clone_s_total"] = time.monotonic() - t0
        if pol.pressure:
            c.set_policy(names, policy, pressure_budget_bytes=pressure_budget_bytes or 0)
        if pol.linux_reclaim:
            kc = wait_ksm_converged(timeout_s=KSM_CONVERGE_TIMEOUT_S)
            run.extra["ksm_converge_s"] = getattr(kc, "elapsed_s", None)
        sampler = _Sampler(c, names, baseline)
        sampler.start()
        progress(f"[{policy}] running the workload")
        manager_pid = c.ping().pid
        qemu_pids = [r.qemu_pid for r in c.list_sandboxes() if r.name in names and r.qemu_pid]
        cpu0 = hostcpu.CpuSnapshot.take(manager_pid, qemu_pids)
        t0 = time.monotonic()
        try:
            run.steps = _run_plan(c, names, plan, progress)
        finally:
            sampler.stop()
        run.extra["run_s"] = time.monotonic() - t0
        run.extra.update(hostcpu.CpuSnapshot.take(manager_pid, qemu_pids).since(cpu0))
        last = sampler.last
        run.extra["compress_s_total"] = float(sum(last.get(x, {}).get("compress_s_total", 0.0) for x in names))
        run.extra["restore_s_total"] = float(sum(last.get(x, {}).get("restore_s_total", 0.0) for x in names))
        for key in ("compress_cpu_s_total", "compress_cpu_loops_below_s_total"):
            run.extra[key] = float(sum(last.get(x, {}).get(key, 0.0) for x in names))
        run.extra.update(compress_cpu_per_wait(c, names))
        run.extra["host_parts_bytes_avg"] = {part: _twa(sampler.t_s, y) for part, y in sampler.parts.items()}
        run.series = {"t_s": sampler.t_s, "owned_bytes": sampler.owned, "host_used_bytes": sampler.host_used,
                      "store_bytes": sampler.store, "store_live_bytes": sampler.store_live, "zram_bytes": sampler.zram,
                      "manager_rss_bytes": sampler.manager_rss, "qemu_own_bytes": sampler.qemu_own,
                      "host_cost_bytes": sampler.host_cost, "manager_anon_bytes": sampler.manager_anon}
    # The idle host again once the sandboxes are gone and the host is put back: a baseline
    # taken while the kernel was still freeing an earlier domain's memory shows as a drop here,
    # memory that came during the run and stayed as a rise; either moved this policy's host
    # cost the same way (report.idle_drift_note). The idle host alone moves by tens of MiB
    # (MemAvailable's estimate of reclaimable cache; docs/figures.md, session 16).
    # The host is given a little time to free what the teardown let go (hostmem.wait_back_to):
    # the next policy's baseline is taken after this one's.
    return_s = hostmem.wait_back_to(baseline.used_bytes)
    after = hostmem.idle_baseline(duration_s=2.0)
    counted = hostmem.counted_idle_bytes(baseline.used_bytes, after.used_bytes)
    run.extra.update(host_idle_used_bytes=baseline.used_bytes, host_idle_after_used_bytes=after.used_bytes,
                     host_idle_drift_bytes=after.used_bytes - baseline.used_bytes, host_return_s=return_s,
                     host_idle_counted_bytes=counted)
    rebase_host_series(run.series, baseline.used_bytes - counted)
    return run


def rebase_host_series(series: dict[str, list[float]], raise_bytes: int) -> None:
    """Add ``raise_bytes`` to every sample of host memory above idle (``host_used_bytes``,
    ``host_cost_bytes``): the series were sampled against the idle host before the run, and
    the policy is counted against the lower idle figure (hostmem.counted_idle_bytes)."""
    if raise_bytes:
        for key in ("host_used_bytes", "host_cost_bytes"):
            if key in series:
                series[key] = [v + raise_bytes for v in series[key]]


def compress_cpu_per_wait(c: Client, names: list[str]) -> dict[str, Any]:
    """Compression CPU per finished compression (one per LLM wait that outlasted the grace
    period), read fresh at the end of the run: ``compress_cpu_s_per_wait`` (None without a
    compression), and per MiB that reached the encoder (``compress_cpu_s_per_encoded_mib``:
    pages new or changed since they were stored, about what the guest wrote; unchanged
    copies are skipped). The CPU of a compression a resume cancelled counts, the
    compression and its pages not."""
    cpu, count, encoded = 0.0, 0, 0
    try:
        rows = c.owned(names).as_json()["sandboxes"]
        cpu = float(sum(rows[n].get("compress_cpu_s_total", 0.0) for n in names if n in rows))
        encoded = int(sum(rows[n].get("compress_encoded_bytes_total", 0) for n in names if n in rows))
        count = sum(c.domstats(n).compress_count for n in names)
    except AzqemuError as exc:
        log.warning("compressions not counted: %s", exc)
        return {}
    return {"compressions": count, "compress_cpu_s_per_wait": cpu / count if count else None,
            "compress_encoded_bytes_total": encoded,
            "compress_cpu_s_per_encoded_mib": cpu / (encoded / (1 << 20)) if encoded else None}


def policy_short(policy: str) -> str:
    return {"none": "n", "none-cow": "c", "linux": "l", "agentzip": "a", "agentzip-no-prefetch": "anp",
            "agentzip-no-sibling": "ans", "agentzip-pressure": "ap"}.get(policy, policy[:4])


def destroy_prefixed(c: Client, prefix: str) -> int:
    """Destroy every sandbox whose name has this benchmark prefix (what a killed or
    interrupted run left behind); returns how many there were."""
    try:
        left = [s.name for s in c.list_sandboxes() if s.name.startswith(prefix)]
    except AzqemuError as exc:
        log.warning("cannot list sandboxes to clean up: %s", exc)
        return 0
    destroy_all(c, left)
    return len(left)


def destroy_all(c: Client, names: list[str]) -> None:
    for name in names:
        try:
            c.destroy(name)
        except AzqemuError as exc:
            log.warning("destroy %s: %s", name, exc)


def summarize(wl: Workload, sandboxes: int, runs: list[PolicyRun], template_bytes: int) -> dict[str, Any]:
    """The result in the stable JSON contract (DESIGN.md), plus series and per-step details.

    Host cost (the headline) = host memory in use above the idle baseline minus QEMU's own
    non-guest memory summed over the policy's domains, sample by sample."""
    policies: dict[str, Any] = {}
    for run in runs:
        s = run.series
        lat = [st.latency_s for st in run.steps]
        steps = [st.__dict__ for st in run.steps]
        cost = s.get("host_cost_bytes") or [h - q for h, q in zip(s["host_used_bytes"], s["qemu_own_bytes"])]
        anon = s.get("manager_anon_bytes") or []
        idle_anon = float(run.extra.get("manager_idle_anon_bytes", 0))
        policies[run.policy] = {
            "owned_bytes_avg": _twa(s["t_s"], s["owned_bytes"]),
            "owned_bytes_peak": float(max(s["owned_bytes"])) if s["owned_bytes"] else float("nan"),
            "host_used_bytes_avg": _twa(s["t_s"], s["host_used_bytes"]),
            "tool_latency_s": hostmem.latency_summary(lat),
            "compress_s_total": run.extra.get("compress_s_total", 0.0),
            "restore_s_total": run.extra.get("restore_s_total", 0.0),
            "owned_bytes_avg_per_sandbox": _twa(s["t_s"], s["owned_bytes"]) / sandboxes,
            "qemu_own_bytes_avg": _twa(s["t_s"], s["qemu_own_bytes"]) / sandboxes,
            "store_bytes_avg": _twa(s["t_s"], s["store_bytes"]),
            # A series without it (made before it was sampled) is unknown, not all dead.
            "store_live_bytes_avg": _twa(s["t_s"], s["store_live_bytes"]) if "store_live_bytes" in s else float("nan"),
            "zram_bytes_avg": _twa(s["t_s"], s["zram_bytes"]),
            "manager_rss_bytes_avg": _twa(s["t_s"], s["manager_rss_bytes"]),
            "host_cost_bytes_avg": _twa(s["t_s"], cost),
            "host_cost_bytes_peak": float(max(cost)) if cost else float("nan"),
            "manager_anon_bytes_avg": _twa(s["t_s"], anon) if anon else float("nan"),
            "manager_anon_above_idle_bytes_avg": _twa(s["t_s"], anon) - idle_anon if anon else float("nan"),
            "compress_cpu_s_total": run.extra.get("compress_cpu_s_total", 0.0),
            "tool_latencies_s": lat,
            "failed_steps": sum(1 for st in run.steps if st.exit_code != 0),
            "steps": steps,
            "tool_latency_by_kind": toolcalls.by_kind(steps),
            "tool_call_breakdown": toolcalls.breakdown(steps),
            "series": s,
            **{k: v for k, v in run.extra.items()
               if k not in ("compress_s_total", "restore_s_total", "compress_cpu_s_total")},
        }
    return {"workload": wl.name, "sandboxes": sandboxes, "policies": policies, "template_bytes": template_bytes}


# What differs between policies by nature, not by a wrong page: unittest's summary line carries
# the run's own duration ("Ran 12 tests in 0.413s"), and `ls -l` the modification time of files
# a call wrote ("Dec  6 09:53", or "Dec  6  2025" past six months), which is wall-clock time:
# guests keep the host's clock (daemon/guestclock.py) and the policies run minutes apart.
_UNITTEST_TIME = re.compile(rb"^(Ran \d+ tests? in )\d+(?:\.\d+)?s$", re.M)
_LS_MTIME = re.compile(rb"(?<= )(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d (?:[ \d]\d:\d\d| \d{4})(?= )")


def comparable_output(out: bytes) -> bytes:
    """A step's output with the run-time figures tools print about themselves, and the
    wall-clock times of files, masked, so that the policies' outputs can be compared byte for
    byte (outputs_identical)."""
    return _LS_MTIME.sub(b"<mtime>", _UNITTEST_TIME.sub(rb"\1<t>s", out))


def outputs_identical(result: dict[str, Any]) -> list[str]:
    """Steps whose exit code or output differ between policies, or between the rounds of a
    policy, from the first policy's first round (should be none)."""
    pols = list(result["policies"])
    ref = {(s["sandbox"], s["step"]): s for s in result["policies"][pols[0]]["steps"] if not s.get("round")}
    diffs = []
    for p in pols:
        for s in result["policies"][p]["steps"]:
            r = ref.get((s["sandbox"], s["step"]))
            if r is None or (r["exit_code"], r["output_sha"]) != (s["exit_code"], s["output_sha"]):
                where = f" in round {s['round'] + 1}" if "round" in s else ""
                diffs.append(f"{p}: sandbox {s['sandbox']} step {s['step']} ({s['label']}){where} "
                             f"differs from {pols[0]}")
    return diffs


def parse_policy_graces(values: Iterable[str], policies: list[str]) -> dict[str, float]:
    """``POLICY=SECONDS`` items (``--policy-grace linux=1.0``) as a dict; a malformed item, an
    unknown policy, a policy named twice or not among ``policies`` (the run's), or a grace that
    is not a finite number >= 0 is a ``ConfigError`` naming the item."""
    out: dict[str, float] = {}
    for item in values:
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ConfigError(f"policy grace {item!r}: expected POLICY=SECONDS (for example linux=1.0)")
        policy_mod.get(name)
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise ConfigError(f"policy grace {item!r}: the grace must be a number of seconds >= 0")
        if name in out:
            raise ConfigError(f"policy grace {item!r}: {name} is given a grace twice")
        out[name] = seconds
    _check_grace_policies(out, policies)
    return out


def _check_grace_policies(graces: Mapping[str, float], policies: list[str]) -> None:
    stray = sorted(set(graces) - set(policies))
    if stray:
        raise ConfigError(f"a grace is given for {', '.join(stray)}, which this run does not run")


def run_density(wl: Workload, sandboxes: int, policies: list[str], *, seed: int = 0, scale: str = "full",
                grace_s: float = policy_mod.DEFAULT_GRACE_S, grace_by_policy: Mapping[str, float] | None = None,
                pressure_budget_bytes: int | None = None, round_count: int = 1,
                progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Every policy ``round_count`` times, the order reversed every other round (rounds.py).
    Each policy acts after ``grace_by_policy[policy]`` seconds of an LLM wait where given, else
    ``grace_s``: a baseline tuned as its operator would tune it (linux owned less at 1.0 s than
    at 0.25 s on coding-agent, agentzip far more: docs/figures.md, session 30)."""
    for p in policies:
        policy_mod.get(p)
    if len(set(policies)) != len(policies):
        raise ConfigError("a policy is named twice")
    if round_count < 1:
        raise ConfigError(f"rounds must be at least 1, not {round_count}")
    graces = dict(grace_by_policy or {})
    _check_grace_policies(graces, policies)
    # SIGTERM and SIGHUP end the run like Ctrl-C: sandboxes destroyed, the host put back.
    with signals_raise():
        return _run_density(wl, sandboxes, policies, seed=seed, scale=scale,
                            graces={p: graces.get(p, grace_s) for p in policies},
                            pressure_budget_bytes=pressure_budget_bytes, round_count=round_count,
                            progress=progress)


def _run_density(wl: Workload, sandboxes: int, policies: list[str], *, seed: int, scale: str,
                 graces: dict[str, float], pressure_budget_bytes: int | None, round_count: int,
                 progress: Callable[[str], None]) -> dict[str, Any]:
    c = Client()
    left = destroy_prefixed(c, BENCH_PREFIX)
    if left:
        progress(f"destroyed {left} sandboxes an earlier benchmark run left behind")
    template = ensure_workload_template(c, wl, progress)
    tmeta = next(t.as_json() for t in c.template_list() if t.name == template)
    plan = wl.plan(sandboxes, seed, scale)
    if pressure_budget_bytes is None:
        # Budget for the pressure ablation: half of what the sandboxes hold uncompressed.
        pressure_budget_bytes = sandboxes * tmeta["ram_data_bytes"] // 2
    manager_idle = _manager_memory(c)      # before any sandbox of this run
    orders = [rounds.round_order(policies, r) for r in range(round_count)]
    results = []
    for r, order in enumerate(orders):
        runs: dict[str, PolicyRun] = {}
        for p in order:
            if round_count > 1:
                progress(f"round {r + 1} of {round_count}: {p}")
            runs[p] = run_policy(c, template, wl, plan, p, grace_s=graces[p], progress=progress,
                                 pressure_budget_bytes=pressure_budget_bytes, manager_idle=manager_idle)
            progress(f"[{p}] done: {runs[p].extra.get('run_s', 0):.0f} s")
        # Each round's result lists the policies in the order given, whatever order they ran in.
        results.append(summarize(wl, sandboxes, [runs[p] for p in policies], tmeta["ram_data_bytes"]))
    result = rounds.merge(results, orders)
    # The manager before the run and once every sandbox of it is gone (it should be back).
    result["manager_idle"], result["manager_after"] = manager_idle, _manager_memory(c)
    return result


def ensure_workload_template(c: Client, wl: Workload, progress: Callable[[str], None]) -> str:
    """The template a workload asks for (made once and reused across runs and policies, for
    as long as the guest image stays the same). Templates this function made for the same
    workload on an earlier image are deleted when no sandbox uses them."""
    image_key = find_image().key
    key = hashlib.sha256(repr((wl.template.mem_mib, wl.template.vcpus, wl.template.warmup,
                               image_key)).encode()).hexdigest()[:8]
    prefix = f"wl-{wl.name}-"[:39]
    name = f"{prefix}{key}"
    templates = [t.as_json() for t in c.template_list()]
    for t in templates:
        if t["name"].startswith(prefix) and t["name"] != name and t.get("clones", 0) == 0:
            progress(f"deleting template {t['name']} (made for another guest image or workload)")
            c.template_delete(t["name"])
    if not any(t["name"] == name for t in templates):
        progress(f"creating template {name}")
        c.template_create(name, mem_mib=wl.template.mem_mib, vcpus=wl.template.vcpus,
                          warmup=list(wl.template.warmup))
    return name
