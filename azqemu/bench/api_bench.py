"""``azq bench api``: the daemon's own API latency under load.

N clients, each with its own keep-alive connection, call cheap read-only routes of the running
daemon in turn (ping, the sandbox list, the template list, and one sandbox's dominfo and
domstats when a sandbox exists) for a few seconds, as fast as the answers come. What is
measured is a request's round trip as an HTTP client sees it (connection already open, the
body read, not parsed): the daemon's routing, guard, thread pool and operation, and the
unix socket or TCP in between. The clients are asyncio tasks in one thread, so the load
generator spends little CPU of its own on a host whose cores the daemon needs.

The result's keys are stable (docs/api.md, "Benchmark: azq bench api"); latencies in
milliseconds, rates per second of the measured window (the warm-up is not counted).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from azqemu import __version__
from azqemu.api import PREFIX
from azqemu.client import CONNECT_TIMEOUT_S, Client, endpoint
from azqemu.errors import ConfigError
from azqemu.names import validate_name

DEFAULT_CLIENTS = 8
DEFAULT_DURATION_S = 5.0
# The first requests open connections and warm the daemon's thread pool: not counted.
WARMUP_S = 0.5
MAX_CLIENTS = 256              # above the daemon's 64 requests in flight: DaemonBusy shows
MAX_DURATION_S = 600.0
# One request that takes longer than this is an error (the daemon is stuck, not slow).
REQUEST_TIMEOUT_S = 30.0


@dataclass
class _Samples:
    latencies_s: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)


def routes(sandbox: str | None) -> list[tuple[str, str]]:
    """The calls in the order each client makes them: (route as in docs/api.md, path)."""
    out = [(f"GET {PREFIX}/ping", f"{PREFIX}/ping"), (f"GET {PREFIX}/sandboxes", f"{PREFIX}/sandboxes"),
           (f"GET {PREFIX}/templates", f"{PREFIX}/templates")]
    if sandbox is not None:
        out += [(f"GET {PREFIX}/sandboxes/{{name}}", f"{PREFIX}/sandboxes/{sandbox}"),
                (f"GET {PREFIX}/sandboxes/{{name}}/domstats", f"{PREFIX}/sandboxes/{sandbox}/domstats")]
    return out


def _stats(lat_s: list[float]) -> dict[str, float | None]:
    if not lat_s:
        return {"median": None, "p95": None, "p99": None, "max": None, "mean": None}
    a = np.array(lat_s) * 1000.0
    return {"median": float(np.median(a)), "p95": float(np.percentile(a, 95)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max()), "mean": float(a.mean())}


def _error_type(r: httpx.Response) -> str:
    try:
        return str(json.loads(r.content)["error"]["type"])[:64]
    except (ValueError, KeyError, TypeError):
        return f"HTTP{r.status_code}"


async def _client(h: httpx.AsyncClient, calls: list[tuple[str, str]], offset: int, t_start: float,
                  t_end: float, samples: dict[str, _Samples]) -> None:
    i = offset   # clients start at different routes: every route is under load at once
    while True:
        now = time.perf_counter()
        if now >= t_end:
            return
        label, path = calls[i % len(calls)]
        i += 1
        t0 = time.perf_counter()
        err: str | None = None
        try:
            r = await h.get(path)
            if r.status_code >= 400:
                err = _error_type(r)
        except httpx.HTTPError as exc:
            err = type(exc).__name__
        dt = time.perf_counter() - t0
        if t0 < t_start:
            continue    # warm-up
        s = samples[label]
        if err is None:
            s.latencies_s.append(dt)
        else:
            s.errors[err] = s.errors.get(err, 0) + 1


async def _load(clients: int, calls: list[tuple[str, str]], duration_s: float, warmup_s: float,
                uds: str | None, base_url: str, headers: dict[str, str]) -> tuple[dict[str, _Samples], float]:
    samples = {label: _Samples() for label, _ in calls}
    # One TLS context for all (each of its own would load the CA bundle: tens of milliseconds
    # of the load generator's one thread per client, counted in the first requests' latency).
    tls: ssl.SSLContext | bool = False if uds else ssl.create_default_context()
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    async with contextlib.AsyncExitStack() as stack:
        hs = [await stack.enter_async_context(httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=uds, verify=tls), base_url=base_url, headers=headers,
            timeout=timeout)) for _ in range(clients)]
        t_start = time.perf_counter() + warmup_s
        t_end = t_start + duration_s
        await asyncio.gather(*(_client(h, calls, k, t_start, t_end, samples) for k, h in enumerate(hs)))
        return samples, time.perf_counter() - t_start


def run(*, clients: int = DEFAULT_CLIENTS, duration_s: float = DEFAULT_DURATION_S,
        sandbox: str | None = None, warmup_s: float = WARMUP_S, socket_path: str | None = None,
        url: str | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Load the daemon with ``clients`` concurrent clients for ``duration_s``; the figures.
    ``sandbox``: whose dominfo and domstats are called (default: the first listed, if any;
    "" for none). A daemon that does not answer, or an unknown sandbox, fails before any load."""
    if isinstance(clients, bool) or not isinstance(clients, int) or not 1 <= clients <= MAX_CLIENTS:
        raise ConfigError(f"clients: expected an integer from 1 to {MAX_CLIENTS}, got {clients!r}")
    for what, v, lo, hi in (("duration_s", duration_s, 0.1, MAX_DURATION_S), ("warmup_s", warmup_s, 0.0, 60.0)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
            raise ConfigError(f"{what}: expected seconds from {lo:g} to {hi:g}, got {v!r}")
    with Client(socket_path, url=url) as c:
        ping = c.ping()   # DaemonUnavailable: one line, before any load
        if sandbox is None:
            rows = c.list_sandboxes()
            sandbox = rows[0].name if rows else None
        elif sandbox == "":
            sandbox = None
        else:
            validate_name(sandbox, "sandbox name")
            c.dominfo(sandbox)   # SandboxNotFound before the load
    ep = endpoint(socket_path, url)
    calls = routes(sandbox)
    if progress is not None:
        progress(f"{clients} client(s) for {duration_s:g} s (after {warmup_s:g} s of warm-up) "
                 f"against {ep.where}: {', '.join(p for _, p in calls)}")
    samples, measured_s = asyncio.run(_load(clients, calls, float(duration_s), float(warmup_s),
                                            ep.uds, ep.base_url, ep.headers))
    measured_s = max(measured_s, 1e-9)
    per: dict[str, Any] = {}
    all_lat: list[float] = []
    all_err: dict[str, int] = {}
    for label, s in samples.items():
        n_err = sum(s.errors.values())
        per[label] = {"requests": len(s.latencies_s) + n_err, "ok": len(s.latencies_s), "errors": n_err,
                      "error_types": dict(sorted(s.errors.items())),
                      "requests_per_s": (len(s.latencies_s) + n_err) / measured_s,
                      "latency_ms": _stats(s.latencies_s)}
        all_lat += s.latencies_s
        for k, v in s.errors.items():
            all_err[k] = all_err.get(k, 0) + v
    total = len(all_lat) + sum(all_err.values())
    return {"benchmark": "api", "version": __version__, "where": ep.where, "daemon_pid": ping.pid,
            "clients": clients, "duration_s": measured_s, "warmup_s": float(warmup_s), "sandbox": sandbox,
            "requests": total, "ok": len(all_lat), "errors": sum(all_err.values()),
            "error_types": dict(sorted(all_err.items())), "requests_per_s": total / measured_s,
            "latency_ms": _stats(all_lat), "endpoints": per}


def table(result: dict[str, Any]) -> str:
    """The result as a text table: one row per route, then all of them."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [f"{result['clients']} client(s), {result['duration_s']:.1f} s against {result['where']}",
             f"{'route':<44} {'req/s':>8} {'median ms':>10} {'p95 ms':>8} {'p99 ms':>8} {'max ms':>8} {'errors':>7}"]
    rows = [*result["endpoints"].items(), ("all", result)]
    for label, r in rows:
        lat = r["latency_ms"]
        lines.append(f"{label[:44]:<44} {r['requests_per_s']:>8.1f} {ms(lat['median']):>10} {ms(lat['p95']):>8} "
                     f"{ms(lat['p99']):>8} {ms(lat['max']):>8} {r['errors']:>7}")
    if result["error_types"]:
        lines.append("errors: " + ", ".join(f"{k} {v}" for k, v in result["error_types"].items()))
    return "\n".join(lines)
