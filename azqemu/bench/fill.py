"""The fill check (``azq bench fill``): how many sandboxes really fit in a memory budget.

The capacity sweep (``azq bench capacity``) predicts it from a fitted line; this runs it. Per
policy: one memory cgroup limited to the budget (``host/memcg.py``) holds the manager and
every sandbox's QEMU; sandboxes are added ``step`` at a time, each playing its workload plan
over and over, and after each addition the tool calls of a window are timed. The fill stops
at the first of: the kernel's OOM killer kills something in the cgroup, a sandbox dies or a
tool call fails, the limit cannot be kept (the kernel cannot reclaim below it), the median
tool call of the window exceeds ``slowdown`` times the first fan-out's, or ``max_sandboxes``.
``filled`` is the last fan-out whose window passed.

What the cgroup sees: whatever the manager and the QEMUs allocate after they are moved in
(guest pages, QEMU's own memory, the store's tmpfs arenas, page cache they read first). Not
charged to any cgroup: zram's compressed pages and KSM's metadata. zram's are counted by
lowering the limit by zram's ``mem_used_total`` every sample (the Linux configuration pays
for what it swapped). A QEMU's start-up allocations before it is moved in are not counted
(small for a copy-on-write clone: the device state). The manager is shielded from the OOM
killer meanwhile (QEMUs at ``oom_score_adj`` +1000, the manager at -1000 where the host allows
it, put back after): the store holds the only copy of compressed guests' pages; a QEMU is what
an over-full host loses.

Result (JSON, stable keys): ``{"workload", "budget_bytes", "policies": {P: {"filled",
"stop_reason", "predicted_with_qemu", "points": [...]}}}``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

from azqemu.bench.capacity import sandboxes_that_fit
from azqemu.bench.density import (
    BENCH_PREFIX,
    destroy_all,
    destroy_prefixed,
    ensure_workload_template,
    policy_short,
)
from azqemu.bench.hostmem import latency_summary
from azqemu.bench.workload import Step, Workload
from azqemu.client import Client
from azqemu.errors import AzqemuError, ConfigError, HostError
from azqemu.host import memacct
from azqemu.host.linuxmm import signals_raise
from azqemu.host.memcg import MemoryCgroup
from azqemu.sched import policy as policy_mod

log = logging.getLogger(__name__)

FILL_PREFIX = f"{BENCH_PREFIX}f"     # sandboxes azq-d-f<policy>-N: a density run cleans them too
SAMPLE_S = 0.5
DEFAULT_POLICIES = ("none-cow", "linux", "agentzip")
STOPS = ("oom", "sandbox-died", "step-failed", "over-budget", "latency", "clone-failed", "max-sandboxes")


@dataclass
class FillPoint:
    sandboxes: int
    usage_bytes_avg: float
    usage_bytes_peak: float
    zram_bytes_avg: float
    tool_calls: int
    tool_latency_median_s: float | None
    tool_latency_p95_s: float | None
    failed_steps: int
    oom_kills: int
    passed: bool
    stop_reason: str | None = None


@dataclass
class _Calls:
    """Tool calls of every player: (end time, latency s, ok)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    rows: list[tuple[float, float, bool]] = field(default_factory=list)

    def add(self, end: float, latency: float, ok: bool) -> None:
        with self.lock:
            self.rows.append((end, latency, ok))

    def since(self, t0: float) -> list[tuple[float, float, bool]]:
        with self.lock:
            return [r for r in self.rows if r[0] >= t0]


def _play(c: Client, name: str, steps: list[Step], calls: _Calls, stop: threading.Event) -> None:
    """One sandbox's plan, over and over, until ``stop``."""
    while not stop.is_set():
        for step in steps:
            if stop.is_set():
                return
            t0 = time.monotonic()
            try:
                ok = c.exec(name, ["/bin/sh", "-c", step.tool], timeout_s=step.timeout_s).exit_code == 0
            except AzqemuError:
                ok = False
            t1 = time.monotonic()
            calls.add(t1, t1 - t0, ok)      # ok: exit code 0, as the density benchmark counts
            with contextlib.suppress(AzqemuError):
                c.phase(name, "wait")
            if stop.wait(step.wait_s):
                return


def window_verdict(latencies_s: list[float], base_median_s: float | None, slowdown: float, *,
                   failed: int, oom_kills: int, died: bool, over_budget: bool) -> str | None:
    """Why a fan-out's window failed (one of STOPS), or None when it passed."""
    if oom_kills:
        return "oom"
    if died:
        return "sandbox-died"
    if failed:
        return "step-failed"
    if over_budget:
        return "over-budget"
    if base_median_s and latencies_s and statistics.median(latencies_s) > slowdown * base_median_s:
        return "latency"
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


class _OomShield:
    """The manager out of the OOM killer's way for the duration: its ``oom_score_adj`` at
    -1000 where the host lets us lower it (CAP_SYS_RESOURCE; put back after), and every
    sandbox's QEMU at +1000 (raising needs no privilege; they are destroyed after)."""

    def __init__(self, pid: int) -> None:
        self.path = f"/proc/{pid}/oom_score_adj"
        with open(self.path) as f:
            self.old = f.read().strip()
        try:
            with open(self.path, "w") as f:
                f.write("-1000")
            self.manager_shielded = True
        except PermissionError:
            log.warning("cannot lower the manager's OOM score here (no CAP_SYS_RESOURCE): QEMUs go first")
            self.manager_shielded = False

    @staticmethod
    def expose(pid: int) -> None:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")

    def close(self) -> None:
        if self.manager_shielded:
            with contextlib.suppress(OSError), open(self.path, "w") as f:
                f.write(self.old)


def fill_policy(c: Client, template: str, wl: Workload, policy: str, budget_bytes: int, *, step: int,
                max_sandboxes: int, window_s: float, slowdown: float, seed: int, scale: str, grace_s: float,
                progress: Callable[[str], None]) -> dict[str, Any]:
    pol = policy_mod.get(policy)
    plan = wl.plan(max_sandboxes, seed, scale)
    points: list[FillPoint] = []
    stop_reason = "max-sandboxes"
    calls, stop = _Calls(), threading.Event()
    players: list[threading.Thread] = []
    prefix = f"{FILL_PREFIX}{policy_short(policy)}-"
    with ExitStack() as stack:
        if pol.linux_reclaim:
            from azqemu.host.linuxmm import LinuxConfig, zram_disksize_for

            stack.enter_context(LinuxConfig(zram_disksize_bytes=zram_disksize_for(
                max_sandboxes * (wl.template.mem_mib << 20))))
        daemon_pid = c.ping().pid
        cg = stack.enter_context(MemoryCgroup(f"azq-fill-{os.getpid()}", budget_bytes))
        shield = _OomShield(daemon_pid)
        stack.callback(shield.close)
        cg.add(daemon_pid)
        names: list[str] = []
        qemu_pids: list[int] = []

        def join_players() -> None:
            for t in players:
                t.join(30)
        # Unwound in reverse: stop the players, destroy the sandboxes (which ends the tool
        # calls still running), then wait for the players.
        stack.callback(join_players)
        stack.callback(destroy_prefixed, c, prefix)
        stack.callback(stop.set)
        # First of all: a process stuck at the limit (the manager too: the OOM killer spares
        # it) must be let go before the sandboxes are destroyed through it.
        stack.callback(cg.lift_limit)
        base_median: float | None = None
        while len(names) < max_sandboxes:
            add = min(step, max_sandboxes - len(names))
            progress(f"[{policy}] {len(names) + add} sandboxes")
            try:
                # Cloned by the manager inside the cgroup: near the limit this is what fails.
                rows = c.clone(template, count=add, name_prefix=prefix, policy=policy, grace_s=grace_s,
                               sharing_domain="bench")
                new = [r.name for r in rows]
                names += new
                for n in new:
                    pid = c.dominfo(n).qemu_pid
                    if not pid:
                        raise HostError(f"sandbox {n} has no QEMU process")
                    cg.add(pid)
                    shield.expose(pid)
                    qemu_pids.append(pid)
            except AzqemuError as exc:
                progress(f"[{policy}] {len(names) + add} sandboxes: clone failed: {exc}")
                stop_reason = "clone-failed"
                break
            for i, n in enumerate(new, start=len(names) - len(new)):
                t = threading.Thread(target=_play, args=(c, n, plan[i], calls, stop), daemon=True,
                                     name=f"azq-fill-{i}")
                t.start()
                players.append(t)
            fp = _window(cg, calls, qemu_pids, window_s, budget_bytes, base_median, slowdown)
            points.append(fp)
            if base_median is None:
                base_median = fp.tool_latency_median_s
            progress(f"[{policy}] {len(names)} sandboxes: usage {fp.usage_bytes_peak / 2**20:.0f} MiB peak, "
                     f"median tool call {fp.tool_latency_median_s or 0:.2f} s"
                     + (f": {fp.stop_reason}" if fp.stop_reason else ""))
            if fp.stop_reason:
                stop_reason = fp.stop_reason
                break
        cg.lift_limit()
        stop.set()
        destroy_all(c, names)
    filled = max((p.sandboxes for p in points if p.passed), default=0)
    return {"filled": filled, "stop_reason": stop_reason, "manager_oom_shielded": shield.manager_shielded,
            "points": [asdict(p) for p in points]}


def _window(cg: MemoryCgroup, calls: _Calls, pids: list[int], window_s: float, budget_bytes: int,
            base_median_s: float | None, slowdown: float) -> FillPoint:
    """Sample the cgroup for ``window_s`` (stopping early on an OOM kill or a dead QEMU) and
    judge the tool calls that ended meanwhile."""
    t0 = time.monotonic()
    kills0 = cg.oom_kills()
    usage, zram = [], []
    died = over = False
    while time.monotonic() - t0 < window_s:
        z = int(memacct.read_zram_total().get("mem_used_total", 0))
        # zram's pages are charged to no cgroup: the Linux configuration pays for them here.
        limit = max(budget_bytes - z, 1 << 20)
        if limit != cg.limit_bytes and not cg.set_limit(limit):
            over = True
        usage.append(cg.usage_bytes() + z)
        zram.append(z)
        died = not all(_alive(p) for p in pids)
        if died or over or cg.oom_kills() > kills0:
            break
        time.sleep(SAMPLE_S)
    done = calls.since(t0)
    lat = [r[1] for r in done if r[2]]
    failed, kills = sum(1 for r in done if not r[2]), cg.oom_kills() - kills0
    summary = latency_summary(lat) if lat else {"median": None, "p95": None}
    reason = window_verdict(lat, base_median_s, slowdown, failed=failed, oom_kills=kills, died=died,
                            over_budget=over)
    return FillPoint(sandboxes=len(pids), usage_bytes_avg=float(statistics.fmean(usage)) if usage else 0.0,
                     usage_bytes_peak=float(max(usage)) if usage else 0.0,
                     zram_bytes_avg=float(statistics.fmean(zram)) if zram else 0.0, tool_calls=len(done),
                     tool_latency_median_s=summary["median"], tool_latency_p95_s=summary["p95"],
                     failed_steps=failed, oom_kills=kills, passed=reason is None, stop_reason=reason)


def predicted(capacity: dict[str, Any] | None, policy: str, budget_bytes: int) -> int | None:
    """What a capacity sweep's fit predicts for this budget with QEMU's own memory (the
    cgroup holds it), or None without a fit for the policy."""
    pol = (capacity or {}).get("policies", {}).get(policy) or {}
    fixed, marginal = pol.get("fixed_host_cost_bytes"), pol.get("marginal_host_cost_bytes")
    if fixed is None or not marginal or marginal <= 0:
        return None
    return sandboxes_that_fit(budget_bytes, fixed, marginal + float(pol.get("qemu_own_bytes_per_sandbox") or 0.0))


def run_fill(wl: Workload, policies: list[str], budget_bytes: int, *, step: int = 2, max_sandboxes: int = 32,
             window_s: float = 30.0, slowdown: float = 1.5, seed: int = 0, scale: str = "small",
             grace_s: float = policy_mod.DEFAULT_GRACE_S, capacity: dict[str, Any] | None = None,
             progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    for p in policies:
        policy_mod.get(p)
    if budget_bytes <= 0 or step < 1 or max_sandboxes < 1 or window_s <= 0 or slowdown <= 1.0:
        raise ConfigError("fill needs a positive budget, step, max-sandboxes and window, and a slowdown above 1")
    with signals_raise():
        c = Client()
        destroy_prefixed(c, FILL_PREFIX)
        template = ensure_workload_template(c, wl, progress)
        out: dict[str, Any] = {}
        for p in policies:
            r = fill_policy(c, template, wl, p, budget_bytes, step=step, max_sandboxes=max_sandboxes,
                            window_s=window_s, slowdown=slowdown, seed=seed, scale=scale, grace_s=grace_s,
                            progress=progress)
            r["predicted_with_qemu"] = predicted(capacity, p, budget_bytes)
            out[p] = r
            progress(f"[{p}] filled {r['filled']} ({r['stop_reason']})")
    return {"workload": wl.name, "budget_bytes": int(budget_bytes), "step": step, "window_s": window_s,
            "slowdown_bound": slowdown, "scale": scale, "policies": out}


def table(result: dict[str, Any]) -> str:
    lines = [f"fill check: {result['workload']}, budget {result['budget_bytes'] / 2**20:.0f} MiB "
             f"(one memory cgroup: the manager and every QEMU), +{result['step']} sandboxes per "
             f"{result['window_s']:g} s window, latency bound {result['slowdown_bound']:g}x the first",
             "| policy | filled | stop | predicted (capacity fit, with QEMU) | peak usage MiB | median tool s at fill |",
             "|---|---:|---|---:|---:|---:|"]
    for p, r in result["policies"].items():
        last = next((pt for pt in reversed(r["points"]) if pt["passed"]), None)
        peak = max((pt["usage_bytes_peak"] for pt in r["points"]), default=0.0)
        lines.append(f"| {p} | {r['filled']} | {r['stop_reason']} | "
                     f"{r['predicted_with_qemu'] if r['predicted_with_qemu'] is not None else '-'} | {peak / 2**20:.0f} | "
                     + (f"{last['tool_latency_median_s']:.2f}" if last and last["tool_latency_median_s"] else "-") + " |")
    return "\n".join(lines)
