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

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from azqemu.bench import hostmem
from azqemu.bench.workload import Step, Workload
from azqemu.daemon.client import Client
from azqemu.errors import AzqemuError, ConfigError
from azqemu.host import memacct, procfs
from azqemu.image import find_image
from azqemu.sched import policy as policy_mod

log = logging.getLogger(__name__)

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


@dataclass
class PolicyRun:
    policy: str
    series: dict[str, list[float]] = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class _Sampler:
    """Samples host memory and the sandboxes' owned bytes in a thread."""

    def __init__(self, client: Client, names: list[str], baseline_used_bytes: int) -> None:
        self.c, self.names, self.base = client, names, baseline_used_bytes
        self.t_s: list[float] = []
        self.owned: list[float] = []
        self.host_used: list[float] = []
        self.store: list[float] = []
        self.zram: list[float] = []
        self.manager_rss: list[float] = []
        self.qemu_own: list[float] = []
        self.per_sandbox: dict[str, list[float]] = {n: [] for n in names}
        self.last: dict[str, Any] = {}
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="azq-density-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def sample(self) -> None:
        r = self.c.call("owned", names=self.names)
        host = procfs.read_meminfo()
        zram = memacct.read_zram_total()
        rows = r["sandboxes"]
        self.t_s.append(time.monotonic() - self._t0)
        self.owned.append(float(sum(rows[n].get("owned_bytes", 0) for n in self.names)))
        self.qemu_own.append(float(sum(rows[n].get("qemu_own_bytes", 0) for n in self.names)))
        for n in self.names:
            self.per_sandbox[n].append(float(rows[n].get("owned_bytes", 0)))
        used = host["MemTotal"] - host["MemAvailable"]
        self.host_used.append(float(used - self.base))
        self.store.append(float(r["store_bytes"]))
        self.zram.append(float(zram.get("mem_used_total", 0)))
        self.manager_rss.append(float(r["manager_rss_bytes"]))
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
    results: list[StepResult] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        name = names[i]
        for k, step in enumerate(plan[i]):
            t0 = time.monotonic()
            try:
                r = c.call("exec", name=name, argv=["/bin/sh", "-c", step.tool], timeout_s=step.timeout_s)
            except AzqemuError as exc:
                # Recorded as a failed step (the summary counts them), the run goes on.
                progress(f"  sandbox {i} step {k} failed: {exc}")
                r = {"exit_code": -1, "stdout_b64": "", "error": str(exc)}
            latency = time.monotonic() - t0
            out = r["stdout_b64"].encode()
            with lock:
                results.append(StepResult(i, k, step.label, r["exit_code"], latency,
                                          hashlib.sha256(out).hexdigest()[:16], r.get("resume_s", 0.0),
                                          r.get("prefetched_pages", 0), r.get("error", "")))
            # The orchestrator now waits for its LLM: say so (the strongest phase source).
            c.call("phase", name=name, phase="wait")
            time.sleep(step.wait_s)
        progress(f"  sandbox {i} done ({len(plan[i])} steps)")

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        for f in [pool.submit(one, i) for i in range(len(names))]:
            f.result()
    return sorted(results, key=lambda s: (s.sandbox, s.step))


def run_policy(c: Client, template: str, wl: Workload, plan: list[list[Step]], policy: str, *,
               grace_s: float, progress: Callable[[str], None], pressure_budget_bytes: int | None) -> PolicyRun:
    pol = policy_mod.get(policy)
    n = len(plan)
    run = PolicyRun(policy)
    with ExitStack() as stack:
        baseline = hostmem.idle_baseline(duration_s=2.0)
        if pol.linux_reclaim:
            from azqemu.host.linuxmm import LinuxConfig, signals_raise, wait_ksm_converged

            stack.enter_context(signals_raise())
            lc = stack.enter_context(LinuxConfig())
            run.extra["zram_algorithm"] = lc.algorithm
        progress(f"[{policy}] cloning {n} sandboxes ({pol.clone_mode})")
        t0 = time.monotonic()
        rows = c.call("clone", template=template, count=n, name_prefix=f"azq-d-{_short(policy)}-",
                      policy=policy, grace_s=grace_s, sharing_domain="bench")
        names = [r["name"] for r in rows]
        stack.callback(_destroy_all, c, names)
        run.extra["clone_s_total"] = time.monotonic() - t0
        if pol.pressure:
            c.call("set_policy", names=names, policy=policy, pressure_budget_bytes=pressure_budget_bytes or 0)
        if pol.linux_reclaim:
            kc = wait_ksm_converged(timeout_s=KSM_CONVERGE_TIMEOUT_S)
            run.extra["ksm_converge_s"] = getattr(kc, "elapsed_s", None)
        sampler = _Sampler(c, names, baseline.used_bytes)
        sampler.start()
        progress(f"[{policy}] running the workload")
        t0 = time.monotonic()
        try:
            run.steps = _run_plan(c, names, plan, progress)
        finally:
            sampler.stop()
        run.extra["run_s"] = time.monotonic() - t0
        last = sampler.last
        run.extra["compress_s_total"] = float(sum(last.get(x, {}).get("compress_s_total", 0.0) for x in names))
        run.extra["restore_s_total"] = float(sum(last.get(x, {}).get("restore_s_total", 0.0) for x in names))
        run.series = {"t_s": sampler.t_s, "owned_bytes": sampler.owned, "host_used_bytes": sampler.host_used,
                      "store_bytes": sampler.store, "zram_bytes": sampler.zram,
                      "manager_rss_bytes": sampler.manager_rss, "qemu_own_bytes": sampler.qemu_own}
    return run


def _short(policy: str) -> str:
    return {"none": "n", "none-cow": "c", "linux": "l", "agentzip": "a", "agentzip-no-prefetch": "anp",
            "agentzip-no-sibling": "ans", "agentzip-pressure": "ap"}.get(policy, policy[:4])


def _destroy_all(c: Client, names: list[str]) -> None:
    for name in names:
        try:
            c.call("destroy", name=name)
        except AzqemuError as exc:
            log.warning("destroy %s: %s", name, exc)


def summarize(wl: Workload, sandboxes: int, runs: list[PolicyRun], template_bytes: int) -> dict[str, Any]:
    """The result in the stable JSON contract (DESIGN.md), plus series and per-step details."""
    policies: dict[str, Any] = {}
    for run in runs:
        s = run.series
        lat = [st.latency_s for st in run.steps]
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
            "zram_bytes_avg": _twa(s["t_s"], s["zram_bytes"]),
            "manager_rss_bytes_avg": _twa(s["t_s"], s["manager_rss_bytes"]),
            "tool_latencies_s": lat,
            "failed_steps": sum(1 for st in run.steps if st.exit_code != 0),
            "steps": [st.__dict__ for st in run.steps],
            "series": s,
            **{k: v for k, v in run.extra.items() if k not in ("compress_s_total", "restore_s_total")},
        }
    return {"workload": wl.name, "sandboxes": sandboxes, "policies": policies, "template_bytes": template_bytes}


def outputs_identical(result: dict[str, Any]) -> list[str]:
    """Steps whose exit code or output differ between policies (should be none)."""
    pols = list(result["policies"])
    if len(pols) < 2:
        return []
    ref = {(s["sandbox"], s["step"]): s for s in result["policies"][pols[0]]["steps"]}
    diffs = []
    for p in pols[1:]:
        for s in result["policies"][p]["steps"]:
            r = ref.get((s["sandbox"], s["step"]))
            if r is None or (r["exit_code"], r["output_sha"]) != (s["exit_code"], s["output_sha"]):
                diffs.append(f"{p}: sandbox {s['sandbox']} step {s['step']} ({s['label']}) differs from {pols[0]}")
    return diffs


def run_density(wl: Workload, sandboxes: int, policies: list[str], *, seed: int = 0, scale: str = "full",
                grace_s: float = policy_mod.DEFAULT_GRACE_S, pressure_budget_bytes: int | None = None,
                progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    for p in policies:
        policy_mod.get(p)
    if len(set(policies)) != len(policies):
        raise ConfigError("a policy is named twice")
    c = Client()
    template = ensure_workload_template(c, wl, progress)
    tmeta = next(t for t in c.call("template_list") if t["name"] == template)
    plan = wl.plan(sandboxes, seed, scale)
    if pressure_budget_bytes is None:
        # Budget for the pressure ablation: half of what the sandboxes hold uncompressed.
        pressure_budget_bytes = sandboxes * tmeta["ram_data_bytes"] // 2
    runs = []
    for p in policies:
        runs.append(run_policy(c, template, wl, plan, p, grace_s=grace_s, progress=progress,
                               pressure_budget_bytes=pressure_budget_bytes))
        progress(f"[{p}] done: {runs[-1].extra.get('run_s', 0):.0f} s")
    return summarize(wl, sandboxes, runs, tmeta["ram_data_bytes"])


def ensure_workload_template(c: Client, wl: Workload, progress: Callable[[str], None]) -> str:
    """The template a workload asks for (made once and reused across runs and policies, for
    as long as the guest image stays the same). Templates this function made for the same
    workload on an earlier image are deleted when no sandbox uses them."""
    image_key = find_image().key
    key = hashlib.sha256(repr((wl.template.mem_mib, wl.template.vcpus, wl.template.warmup,
                               image_key)).encode()).hexdigest()[:8]
    prefix = f"wl-{wl.name}-"[:39]
    name = f"{prefix}{key}"
    templates = c.call("template_list")
    for t in templates:
        if t["name"].startswith(prefix) and t["name"] != name and t.get("clones", 0) == 0:
            progress(f"deleting template {t['name']} (made for another guest image or workload)")
            c.call("template_delete", name=t["name"])
    if not any(t["name"] == name for t in templates):
        progress(f"creating template {name}")
        c.call("template_create", name=name, mem_mib=wl.template.mem_mib, vcpus=wl.template.vcpus,
               warmup=list(wl.template.warmup))
    return name
