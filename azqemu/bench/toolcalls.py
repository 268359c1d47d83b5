"""Where a policy's tool calls spend their time: latency per kind of tool call, and the
parts of each call the manager can see (the density benchmark's breakdown).

A tool call's latency is the guest's own run plus what the manager adds around it: waiting
for an operation on the sandbox to stop (``lock_wait_s``: a compression being cancelled),
the resume (``resume_s``), the trims' pauses while it ran (``trim_paused_s``) and the page
faults the manager served meanwhile (``faults``). Compared per kind (the workload step's
label) against none-cow, the kinds a policy slows down and the part that grew show where
the extra time goes; what no part explains is the guest running slower (CPU taken by the
manager and by the other guests, or faults of the guest's own).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

# The exec reply's parts, in seconds except faults (counts: all, and those the store served).
PARTS = ("lock_wait_s", "resume_s", "trim_paused_s", "faults", "faults_from_store")


def by_kind(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{label: {"calls", "median_s", "p95_s", and the median of each part}} over ``steps``
    (StepResult dicts)."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for st in steps:
        groups[str(st.get("label") or "?")].append(st)
    out: dict[str, dict[str, float]] = {}
    for label, rows in sorted(groups.items()):
        lat = np.asarray([float(r["latency_s"]) for r in rows])
        row = {"calls": float(len(rows)), "median_s": float(np.median(lat)),
               "p95_s": float(np.percentile(lat, 95))}
        for part in PARTS:
            row[f"{part}_median"] = float(np.median([float(r.get(part, 0.0)) for r in rows]))
        out[label] = row
    return out


def breakdown(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Sums over every tool call: latency, each part, and the faults per call."""
    n = len(steps)
    out = {"calls": float(n), "latency_s_sum": float(sum(float(s["latency_s"]) for s in steps))}
    for part in PARTS:
        out[f"{part}_sum"] = float(sum(float(s.get(part, 0.0)) for s in steps))
    out["faults_per_call"] = out["faults_sum"] / n if n else float("nan")
    out["store_faults_per_call"] = out["faults_from_store_sum"] / n if n else float("nan")
    return out


def slowdown_by_kind(result: dict[str, Any], policy: str, base: str = "none-cow") -> dict[str, float]:
    """{label: policy's median latency / ``base``'s} for the kinds both ran."""
    pols = result["policies"]
    if base not in pols or policy not in pols:
        return {}
    mine = pols[policy].get("tool_latency_by_kind", {})
    ref = pols[base].get("tool_latency_by_kind", {})
    return {k: mine[k]["median_s"] / ref[k]["median_s"] for k in mine
            if k in ref and ref[k]["median_s"] > 0}


def markdown_note(result: dict[str, Any], base: str = "none-cow") -> str:
    """One line per policy: slowdown per kind against ``base``, and the manager's parts of the
    tool calls (sums over the run, faults per call)."""
    lines = []
    for name, pol in result["policies"].items():
        b = pol.get("tool_call_breakdown")
        if not b:
            continue
        kinds = slowdown_by_kind(result, name, base) if name != base else {}
        per_kind = ", ".join(f"{k} {v:.2f}x" for k, v in kinds.items())
        lines.append(f"{name}: {int(b['calls'])} tool calls, {b['latency_s_sum']:.1f} s in all, of which "
                     f"lock wait {b['lock_wait_s_sum']:.1f} s, resume {b['resume_s_sum']:.1f} s, "
                     f"trim pauses {b['trim_paused_s_sum']:.1f} s; {b['faults_per_call']:.0f} faults per call"
                     + (f" ({b['store_faults_per_call']:.0f} from the store)" if b.get("faults_sum") else "")
                     + (f"; median per kind over {base}'s: {per_kind}" if per_kind else ""))
    if not lines:
        return ""
    return "Tool calls (where the time went): " + "; ".join(lines) + "."
