"""``azq bench restore --concurrent N``: fault service when N sandboxes fault at once.

N lazy clones of a template each run the working-set process of ``restore_bench`` (the same
guest program, ``hot_mib`` MiB each). All are compressed (one after the other: the vCPUs of
each are paused while it is encoded), all are resumed without prefetch, and then their tool
calls (touch every page of the working set, timing each touch) are started from N threads
released by one barrier, so that every sandbox's working set comes back through its fault
handler at the same time. The manager runs one handler thread per sandbox in one process:
the figure shows what N handlers cost each other (the GIL, the store, the host's 2 cores).

Figures (DESIGN.md, "Figures the benchmarks print": ``{"concurrent": {"sandboxes": N,
"fault_service_us": {"median": x, "p99": x}}}``, extras added freely):

- ``fault_service_us``: per-fault service time over the faults of every handler during the
  concurrent tool calls (fault message read to UFFDIO_COPY done, as in the single-sandbox
  figure). The daemon gives each handler's quantiles (min, median, p90, p99, max) and sample
  count, not the samples, so the pooled quantiles are those of the mixture of the handlers'
  distributions, each interpolated between its known quantiles (linearly in log(1 + x)) and
  weighted by its sample count (``pooled_quantile``): an estimate, ~10% off at p99 on a
  skewed synthetic mix, always between the smallest and the largest handler's own quantile
  (``per_handler``), which are reported beside it;
- ``overlap_s``: how long all N tool calls ran at once (latest start to earliest end, host
  side) against ``span_s`` (earliest start to latest end): a figure is only "at once" if the
  overlap covers most of the span;
- ``fault_stall_us``: the guests' stall per first touch (as in the single figure), pooled the
  same way from each guest's quantiles.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from azqemu.bench.restore_bench import (
    CLONE_PREFIX,
    GUEST_DIR,
    GuestWorkingSet,
    check_daemon,
    check_hot_mib,
    host_idle,
)
from azqemu.client import Client
from azqemu.errors import AzqemuError, ConfigError, SandboxNotFound

# The concurrent mode's own template: small guests, so that 16 fit beside each other on a
# 2-core TCG host (each QEMU also holds a TCG translation cache of tens of MiB).
CONCURRENT_TEMPLATE = "azq-bench-small"
CONCURRENT_MEM_MIB = 256
# Per sandbox: 16 MiB = 4,096 faults each, 65,536 for 16 sandboxes; filling it takes seconds
# per guest under TCG, and every handler's ring (65,536 samples) holds all of its faults.
DEFAULT_CONCURRENT_HOT_MIB = 16
# Waiting on one another: N threads reach the barrier after their guests are resumed.
BARRIER_TIMEOUT_S = 120.0
# The handler quantiles memstats gives, as (fraction, key); min and max close the range.
HANDLER_QUANTILES: tuple[tuple[float, str], ...] = ((0.0, "min"), (0.5, "median"), (0.9, "p90"),
                                                    (0.99, "p99"), (1.0, "max"))
# The guest program's stall quantiles (ns); no min or max-free range: p10 stands in at 0.1.
STALL_QUANTILES: tuple[tuple[float, str], ...] = ((0.1, "p10"), (0.5, "median"), (0.9, "p90"),
                                                  (0.99, "p99"), (1.0, "max"))
BISECT_STEPS = 100


def _cdf_points(summary: dict[str, Any], keys: Sequence[tuple[float, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(values, fractions) of one distribution's known quantiles, values made non-decreasing
    (a summary from float percentiles can be off by rounding)."""
    fr = np.array([q for q, k in keys if k in summary], dtype=np.float64)
    vals = np.maximum.accumulate(np.array([float(summary[k]) for q, k in keys if k in summary], dtype=np.float64))
    return vals, fr


def _cdf(x: float, vals: np.ndarray, fr: np.ndarray) -> float:
    """CDF through the known quantiles, linear in log(1 + x) between them (latencies are
    right-skewed, close to log-normal: linear in x overstated a mixture's p99 by 15% where
    linear in log was 10% off, tests/unit/bench/test_restore_concurrent.py); 0 below the
    first point, 1 above the last."""
    if x < vals[0]:
        return 0.0
    if x >= vals[-1]:
        return 1.0
    # The rightmost point at or below x: flat steps (equal values) jump to their top fraction.
    i = int(np.searchsorted(vals, x, side="right")) - 1
    x0, x1, f0, f1 = np.log1p(vals[i]), np.log1p(vals[i + 1]), fr[i], fr[i + 1]
    return float(f0 + (f1 - f0) * (np.log1p(x) - x0) / (x1 - x0)) if x1 > x0 else float(f1)


def pooled_quantile(summaries: Sequence[dict[str, Any]], q: float, *,
                    keys: Sequence[tuple[float, str]] = HANDLER_QUANTILES, weight_key: str = "samples") -> float:
    """The ``q`` quantile of the samples of several distributions known only by quantiles.

    Each summary (``{"samples": n, "min": x, "median": x, ...}``, values >= 0) stands for a
    distribution whose CDF runs between its known quantiles as ``_cdf`` draws it; the pooled CDF is their mixture
    weighted by sample count, inverted by bisection. Exact for one summary at its own
    quantiles, and always between the smallest and the largest of the summaries' own ``q``
    quantiles. Summaries with no samples are left out; none at all gives NaN."""
    parts = [(float(s[weight_key]), *_cdf_points(s, keys)) for s in summaries if s.get(weight_key)]
    if not parts:
        return float("nan")
    total = sum(w for w, _, _ in parts)

    def mix(x: float) -> float:
        return sum(w * _cdf(x, v, f) for w, v, f in parts) / total

    lo = min(float(v[0]) for _, v, _ in parts)
    hi = max(float(v[-1]) for _, v, _ in parts)
    if mix(lo) >= q:
        return lo
    for _ in range(BISECT_STEPS):   # smallest x with mix(x) >= q
        mid = (lo + hi) / 2
        if mix(mid) >= q:
            hi = mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(1.0, abs(hi)):
            break
    return hi


def pooled(summaries: Sequence[dict[str, Any]], *, keys: Sequence[tuple[float, str]] = HANDLER_QUANTILES,
           weight_key: str = "samples") -> dict[str, Any]:
    """Median and p99 pooled over the summaries, with the range of each one's own."""
    used = [s for s in summaries if s.get(weight_key)]
    out: dict[str, Any] = {"median": pooled_quantile(used, 0.5, keys=keys, weight_key=weight_key),
                           "p99": pooled_quantile(used, 0.99, keys=keys, weight_key=weight_key),
                           "samples": int(sum(int(s[weight_key]) for s in used))}
    out["per_handler"] = {k: {"min": min(float(s[k]) for s in used), "max": max(float(s[k]) for s in used)}
                          for k in ("median", "p99")} if used else {}
    return out


def overlap(intervals: Sequence[tuple[float, float]]) -> dict[str, float]:
    """How long every interval ran at once (latest start to earliest end, 0 if they never all
    did) and the span from the earliest start to the latest end, in seconds."""
    starts = [a for a, _ in intervals]
    ends = [b for _, b in intervals]
    return {"overlap_s": max(0.0, min(ends) - max(starts)), "span_s": max(ends) - min(starts),
            "start_spread_s": max(starts) - min(starts)}


def names_for(n: int) -> list[str]:
    return [f"{CLONE_PREFIX}{os.getpid()}-c{i}" for i in range(n)]


def run(client: Client, *, template: str, sandboxes: int, hot_mib: int = DEFAULT_CONCURRENT_HOT_MIB,
        progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Clone N sandboxes, measure, destroy them (also on failure). Returns ``concurrent``'s dict."""
    if sandboxes < 1:
        raise ConfigError(f"--concurrent {sandboxes}: at least 1 sandbox")
    check_daemon(client)
    check_hot_mib(client, template, hot_mib)
    names = names_for(sandboxes)
    progress(f"cloning {sandboxes} sandboxes from {template} (lazy)")
    try:
        # Policy manual: nothing compresses or resumes them behind the benchmark's back.
        client.clone(template, names=names, ram_mode="lazy", policy="manual")
        result = _measure(client, names, hot_mib, progress)
    except BaseException:
        _destroy_all(client, names, quiet=True)   # the measurement's error is the one to report
        raise
    _destroy_all(client, names, quiet=False)
    result["template"] = template
    return result


def _destroy_all(client: Client, names: list[str], *, quiet: bool) -> None:
    errors = []
    for name in names:
        try:
            client.destroy(name)
        except SandboxNotFound:
            continue
        except AzqemuError as exc:
            errors.append(exc)
    if errors and not quiet:
        raise errors[0]


def _parallel(n: int, fn: Callable[[int], Any]) -> list[Any]:
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="azq-restore-conc") as pool:
        return list(pool.map(fn, range(n)))


def _measure(c: Client, names: list[str], hot_mib: int, progress: Callable[[str], None]) -> dict[str, Any]:
    n = len(names)
    sets = [GuestWorkingSet(c, name) for name in names]
    t0 = time.monotonic()
    _parallel(n, lambda i: sets[i].start(hot_mib))
    progress(f"working sets of {hot_mib} MiB filled in {n} guests in {time.monotonic() - t0:.1f} s")
    _parallel(n, lambda i: sets[i].tool_call())   # warm: the tool call's own code paths resident
    t0 = time.monotonic()
    comp = [c.compress(name).as_json() for name in names]
    progress(f"compressed {n} sandboxes in {time.monotonic() - t0:.1f} s "
             f"({sum(int(r['stored_pages']) for r in comp)} pages stored)")
    for name in names:
        c.resume(name, prefetch=False)
    before = [c.memstats(name, reset=True).as_json() for name in names]
    barrier = threading.Barrier(n, timeout=BARRIER_TIMEOUT_S)
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n

    def touch(i: int) -> dict[str, Any]:
        barrier.wait()
        a = time.monotonic()
        out = sets[i].tool_call()
        spans[i] = (a, time.monotonic())
        return out

    calls = _parallel(n, touch)
    after = [c.memstats(name, reset=True).as_json() for name in names]
    ov = overlap(spans)
    progress(f"{n} concurrent tool calls after a resume without prefetch: overlap {ov['overlap_s']:.2f} s "
             f"of {ov['span_s']:.2f} s")
    for ws in sets:
        with contextlib.suppress(AzqemuError):
            ws._sh(f"echo quit > {GUEST_DIR}/in && cat {GUEST_DIR}/out")
    per_sandbox = []
    for name, b, a, call in zip(names, before, after, calls):
        per_sandbox.append({"sandbox": name, "faults": int(a["handler"]["faults"]) - int(b["handler"]["faults"]),
                            "service_us": a["service_us"], "tool_call_s": call["duration_s"],
                            "stall_us_median": call["stall_ns"]["median"] / 1e3,
                            "handler_errors": int(a["handler"]["errors"])})
    stalls = [{"pages": call["pages"], **{k: v / 1e3 for k, v in call["stall_ns"].items()}} for call in calls]
    service = pooled([a["service_us"] for a in after])
    durations = sorted(call["duration_s"] for call in calls)
    return {
        "sandboxes": n,
        "fault_service_us": {**service, "method": "host: fault message read to UFFDIO_COPY done, every "
                             "handler; quantiles pooled from each handler's (min, median, p90, p99, max)"},
        "fault_stall_us": {**pooled(stalls, keys=STALL_QUANTILES, weight_key="pages"),
                           "method": "guest: first touch minus resident touch (median), pooled over guests"},
        "faults": sum(p["faults"] for p in per_sandbox),
        "hot_mib": hot_mib,
        "tool_call_s": {"median": float(np.median(durations)), "max": durations[-1]},
        **ov,
        "handler_errors": sum(p["handler_errors"] for p in per_sandbox),
        "per_sandbox": per_sandbox,
        "host_idle": host_idle(),
    }

