"""The density benchmark in rounds: every policy runs once per round, and every other round
runs them in reverse order (A B, B A, A B ...: with two rounds, A-B-B-A).

One run per policy cannot tell a policy's effect from the host's drift: on these shared
machines the host cost of the same policy moved by 15-22 MiB between the first and the
second slot of a run, in both orders, and its median tool call by 1.5x. Alternating the
order puts every policy in every slot as often (an even number of rounds cancels a drift
that is linear in time), and the spread between the rounds says how large a difference
has to be to mean something.

``merge`` turns the rounds' density results (each ``density.summarize``'s dict, one per
round) into one result in the same contract: a policy's figures are the means of its
rounds' figures (its peaks the maximum, its failed steps the sum), its latency figures are
taken over every tool call of every round, its steps carry their round, and its series are
the first round's (the memory plot shows one run). ``result["rounds"]`` keeps each round's
order and each policy's figures in that round, so the report can state the spread
(``report.round_spread``).
"""

from __future__ import annotations

import math
from typing import Any

from azqemu.bench import hostmem, toolcalls

# Recomputed from the pooled tool calls rather than averaged over the rounds.
_POOLED = ("tool_latency_s", "tool_latencies_s", "steps", "tool_latency_by_kind", "tool_call_breakdown",
           "series", "failed_steps")
# A round's figures kept in result["rounds"]: those the spread is stated on, and the parts
# a reader checks first when two rounds disagree.
ROUND_FIGURES = ("host_cost_bytes_avg", "owned_bytes_avg", "host_used_bytes_avg", "tool_latency_s",
                 "qemu_own_bytes_avg", "host_parts_bytes_avg", "store_bytes_avg", "zram_bytes_avg",
                 "manager_anon_above_idle_bytes_avg", "host_idle_drift_bytes", "compress_cpu_s_total",
                 "qemu_cpu_s", "manager_cpu_s", "host_cpu_busy_share", "run_s")


def round_order(policies: list[str], round_index: int) -> list[str]:
    """The order of the policies in round ``round_index`` (0-based): as given in even rounds,
    reversed in odd ones."""
    return list(policies) if round_index % 2 == 0 else list(reversed(policies))


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _mean(values: list[Any], key: str) -> Any:
    """The merged value of one key over the rounds: numbers averaged (peaks: the maximum;
    an unknown figure, None or NaN, left out), dicts merged key by key, anything else the
    first round's."""
    if all(isinstance(v, dict) for v in values):
        keys = dict.fromkeys(k for v in values for k in v)
        return {k: _mean([v[k] for v in values if k in v], k) for k in keys}
    known = [float(v) for v in values if _number(v) and math.isfinite(float(v))]
    if not any(_number(v) for v in values):
        return values[0]
    if not known:
        return None if any(v is None for v in values) else float("nan")
    return max(known) if key.endswith("_peak") else sum(known) / len(known)


def _merge_policy(entries: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for e in entries for k in e):
        if key not in _POOLED:
            out[key] = _mean([e[key] for e in entries if key in e], key)
    steps = [{**st, "round": r} for r, e in enumerate(entries) for st in e.get("steps", [])]
    lat = [float(x) for e in entries for x in e.get("tool_latencies_s", [])]
    out.update(tool_latency_s=hostmem.latency_summary(lat), tool_latencies_s=lat, steps=steps,
               tool_latency_by_kind=toolcalls.by_kind(steps), tool_call_breakdown=toolcalls.breakdown(steps),
               failed_steps=sum(int(e.get("failed_steps", 0)) for e in entries),
               series=entries[0].get("series", {}))
    return out


def merge(round_results: list[dict[str, Any]], orders: list[list[str]]) -> dict[str, Any]:
    """One density result from the rounds' results (``orders[r]``: round r's policy order)."""
    if not round_results:
        raise ValueError("no round to merge")
    first = round_results[0]
    if len(round_results) == 1:
        return first
    pols = list(first["policies"])
    result = {k: v for k, v in first.items() if k != "policies"}
    result["policies"] = {p: _merge_policy([rr["policies"][p] for rr in round_results]) for p in pols}
    result["rounds"] = [{"order": order,
                         "policies": {p: {k: rr["policies"][p][k] for k in ROUND_FIGURES if k in rr["policies"][p]}
                                      for p in pols}}
                        for rr, order in zip(round_results, orders)]
    return result
