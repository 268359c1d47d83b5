"""``azq bench restore``: what a compressed sandbox costs when it runs again.

One lazy clone of the bench template runs a resident Python process in the guest that
allocated a working set of ``hot_mib`` MiB (compressible text, distinct per page) and answers
a repeated tool call: read one byte of every page of the working set, timing each read.
The sandbox is compressed (its pages leave QEMU) and resumed twice around that tool call:

1. resume without prefetch, run the tool call: every page of the working set faults and is
   served by the manager's fault handler (host side: per-fault service time; guest side:
   the stall each first touch costs the faulting thread);
2. compress again (the hot set is what the tool call faulted in), resume with prefetch (time
   from the resume request to the vCPUs running, prefetch throughput), run the tool call;
3. once more (``next_cycle``): compress, resume with prefetch, run the tool call, to show
   whether the hot set still predicts the call one cycle later.

Figures (DESIGN.md, "Figures the benchmarks print"; keys stable, extras added freely):

- ``fault_service_us``: the handler's time per fault, from the read of the fault message to
  UFFDIO_COPY done (host side, FaultHandler's ring), over the faults of call 1;
- ``fault_stall_us``: the stall the faulting guest thread sees, measured in the guest: the
  first touch of each working-set page after the resume without prefetch, minus the median
  time of the same touch once the page is resident (the timing loop's own cost, which under
  TCG is several microseconds). It includes the guest-to-host fault path of the emulator,
  the uffd wake-up and the handler's service time;
- ``prefetch_mib_s``: hot-set pages decoded from the store and placed with UFFDIO_COPY, per
  second of prefetch (the manager's figure);
- ``resume_s``: resume request to vCPUs running, prefetch included (the manager's figure; the
  client's round trip is ``resume_rtt_s``);
- ``faults_after_resume``: handler faults from the start to the end of the repeated tool call
  after each resume; ``faults_removed_fraction`` = 1 - with / without.
- ``concurrent`` (with ``--concurrent N``): per-fault service time while N other sandboxes
  fault at once, every handler pooled (restore_concurrent.py).

The stall depends on how fast an idle host CPU wakes up: each fault wakes the handler thread
and then the vCPU thread. On a host that is itself a VM whose idle CPUs halt at once (cpuidle
``haltpoll`` with ``guest_halt_poll_ns`` 0, as on the development machines), that costs ~40 us
per fault: the stall median measured ~70 us on an idle host and ~30 us with a niced busy loop
keeping a CPU awake. ``host_idle`` records the setting beside the figures. The C fault thread
spins after a fault (``AZQ_FAULT_SPIN_US``) so that a guest walking its pages does not wait for
the first of those wake-ups: ``fault_spin`` gives what it caught and the time it spun.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from azqemu.client import Client
from azqemu.errors import (
    ApiNotFound,
    AzqemuError,
    ConfigError,
    DaemonError,
    SandboxError,
    SandboxExists,
    SandboxNotFound,
)

log = logging.getLogger(__name__)

CLONE_PREFIX = "azq-bench-restore-"
# Guest directory of the working-set process (tmpfs in the guest image).
GUEST_DIR = "/tmp/azq-restore-bench"
# The guest needs room beside the working set for its kernel, Python and page cache.
MAX_HOT_FRACTION_OF_GUEST = 0.5
# Allocating and filling the working set runs in an emulated guest (TCG: tens of MiB/s).
READY_TIMEOUT_S = 600.0
READY_POLL_S = 0.5
TOOL_CALL_TIMEOUT_S = 600.0

# The fast-paths issue's targets (figure -> (bound, "max" = at most, "min" = at least)); the
# resume bound is for a 100 MiB hot set. The bench prints each beside its measure, met or not.
TARGETS: dict[str, tuple[float, str]] = {
    "fault_service_us.median": (8.0, "max"),
    "fault_service_us.p99": (30.0, "max"),
    "fault_stall_us.median": (30.0, "max"),
    "prefetch_mib_s": (3072.0, "min"),
    "resume_s": (0.050, "max"),
    "faults_removed_fraction": (0.90, "min"),
}
# With ``--concurrent N`` (the target is for 16 sandboxes faulting at once).
CONCURRENT_TARGETS: dict[str, tuple[float, str]] = {
    "concurrent.fault_service_us.p99": (100.0, "max"),
}

# Runs in the guest (python3 of the image, stdlib only): allocates the working set, then
# serves tool calls over two FIFOs so that the same process, with its pages mapped in the
# guest already, touches the same memory in every call. Only the host side of a page is
# missing after a compression: the first touch costs the uffd round trip and nothing else.
GUEST_PROGRAM = r'''
import array, json, os, random, sys, time

PAGE = 4096
mib, d = int(sys.argv[1]), sys.argv[2]
n = mib * 256
rnd = random.Random(7)
vocab = [w.encode() for w in ("def return self import value result for in range if else None "
                              "True False print data path json error test assert open with as "
                              "class lambda yield try except raise while break").split()]
vocab += [b"name%d" % i for i in range(200)]
text = b" ".join(rnd.choice(vocab) for _ in range(40000))
span = len(text) - PAGE
buf = bytearray(n * PAGE)
for i in range(n):
    o = (i * 4093) % span
    buf[i * PAGE:(i + 1) * PAGE] = text[o:o + PAGE]
    buf[i * PAGE:i * PAGE + 8] = i.to_bytes(8, "little")
first = array.array("q", bytes(8 * n))
again = array.array("q", bytes(8 * n))
try:
    with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as f:
        clocksource = f.read().strip()
except OSError:
    clocksource = "?"


def pct(s, q):
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def touch():
    pc = time.perf_counter_ns
    b, f, a = buf, first, again
    t0 = pc()
    for i in range(n):
        t = pc()
        x = b[i * PAGE + 2048]
        f[i] = pc() - t
    t1 = pc()
    for i in range(n):
        t = pc()
        x = b[i * PAGE + 2048]
        a[i] = pc() - t
    t2 = pc()
    fs, rs = sorted(f), sorted(a)
    base = rs[len(rs) // 2]
    st = sorted(max(0, v - base) for v in f)
    return {"pages": n, "clocksource": clocksource, "first_pass_s": (t1 - t0) / 1e9,
            "resident_pass_s": (t2 - t1) / 1e9,
            "first_ns": {"min": fs[0], "median": pct(fs, 0.5), "p99": pct(fs, 0.99), "max": fs[-1]},
            "resident_ns": {"median": base, "p99": pct(rs, 0.99)},
            "stall_ns": {"p10": pct(st, 0.1), "median": pct(st, 0.5), "p90": pct(st, 0.9), "p99": pct(st, 0.99),
                         "max": st[-1]}}


os.mkfifo(d + "/in")
os.mkfifo(d + "/out")
with open(d + "/ready.tmp", "w") as f:
    f.write("%d\n" % os.getpid())
os.replace(d + "/ready.tmp", d + "/ready")
while True:
    with open(d + "/in") as fi:
        cmd = fi.read().strip()
    out = json.dumps(touch()) if cmd == "touch" else "bye" if cmd == "quit" else "unknown " + cmd
    with open(d + "/out", "w") as fo:
        fo.write(out + "\n")
    if cmd == "quit":
        break
'''


class GuestWorkloadError(SandboxError):
    """The benchmark's program in the guest failed (``sandbox``, ``step``, ``exit_code``)."""

    def __init__(self, sandbox: str, step: str, exit_code: int | None, detail: str) -> None:
        self.sandbox, self.step, self.exit_code_guest, self.detail = sandbox, step, exit_code, detail
        super().__init__(f"{sandbox}: {step} failed in the guest (exit {exit_code}): {detail[-300:]}")


class GuestWorkingSet:
    """The working-set process in one sandbox, driven through the guest agent."""

    def __init__(self, client: Client, sandbox: str) -> None:
        self.c = client
        self.sandbox = sandbox

    def _sh(self, cmd: str, *, timeout_s: float = 60.0, stdin: bytes | None = None) -> tuple[int, str, str, float]:
        r = self.c.exec(self.sandbox, ["/bin/sh", "-c", cmd], timeout_s=timeout_s, stdin=stdin)
        return (r.exit_code, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"), r.duration_s)

    def start(self, hot_mib: int) -> float:
        """Start the process and wait until its working set is filled; returns seconds."""
        t0 = time.monotonic()
        code, _, err, _ = self._sh(f"rm -rf {GUEST_DIR} && mkdir -p {GUEST_DIR} && cat > {GUEST_DIR}/ws.py",
                                   stdin=GUEST_PROGRAM.encode())
        if code != 0:
            raise GuestWorkloadError(self.sandbox, "writing the working-set program", code, err)
        code, _, err, _ = self._sh(f"cd {GUEST_DIR} && nohup python3 ws.py {int(hot_mib)} {GUEST_DIR} "
                                   f">log 2>&1 </dev/null & echo $! > {GUEST_DIR}/pid")
        if code != 0:
            raise GuestWorkloadError(self.sandbox, "starting the working-set program", code, err)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            code, out, _, _ = self._sh(f"cd {GUEST_DIR}; if [ -e ready ]; then echo READY; "
                                       f"elif kill -0 $(cat pid) 2>/dev/null; then echo WAIT; "
                                       f"else echo DEAD; cat log; fi")
            if out.startswith("READY"):
                return time.monotonic() - t0
            if out.startswith("DEAD"):
                raise GuestWorkloadError(self.sandbox, "allocating the working set", code, out[4:])
            time.sleep(READY_POLL_S)
        raise GuestWorkloadError(self.sandbox, "allocating the working set", None,
                                 f"not ready within {READY_TIMEOUT_S:g} s")

    def tool_call(self) -> dict[str, Any]:
        """The repeated tool call: touch every page of the working set, timing each touch."""
        code, out, err, duration_s = self._sh(f"echo touch > {GUEST_DIR}/in && cat {GUEST_DIR}/out",
                                              timeout_s=TOOL_CALL_TIMEOUT_S)
        if code != 0:
            raise GuestWorkloadError(self.sandbox, "the tool call", code, err or out)
        try:
            res: dict[str, Any] = json.loads(out)
        except ValueError as exc:
            raise GuestWorkloadError(self.sandbox, "the tool call", code, f"bad output {out[:200]!r}") from exc
        res["duration_s"] = duration_s
        return res


def check_daemon(client: Client) -> None:
    """Refuse early, in one line, when the running daemon predates the memstats operation."""
    try:
        client.memstats(f"{CLONE_PREFIX}probe")
    except (SandboxNotFound, ConfigError):
        pass  # the operation exists
    except ApiNotFound as exc:
        raise DaemonError("the running azqemu daemon has no memstats operation: it is older than "
                              "this azq; restart it ('azq daemon')") from exc


def check_hot_mib(client: Client, template: str, hot_mib: int) -> None:
    tmpl = next((t.as_json() for t in client.template_list() if t.name == template), None)
    if tmpl is None:
        raise ConfigError(f"no template {template!r}")
    limit = int(tmpl["mem_mib"] * MAX_HOT_FRACTION_OF_GUEST)
    if not 1 <= hot_mib <= limit:
        raise ConfigError(f"--hot-mib {hot_mib} out of range for template {template!r} "
                          f"({tmpl['mem_mib']} MiB guest): 1-{limit}")


def run(client: Client, *, template: str, hot_mib: int = 100,
        progress: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """Clone, measure, destroy (also on failure). Returns the JSON result."""
    check_daemon(client)
    check_hot_mib(client, template, hot_mib)
    name = f"{CLONE_PREFIX}{os.getpid()}"
    progress(f"cloning {name} from {template} (lazy)")
    try:
        # Policy manual: nothing compresses or resumes the clone behind the benchmark's back.
        client.clone(template, names=[name], ram_mode="lazy", policy="manual")
    except SandboxExists:
        raise  # not ours to destroy
    except AzqemuError:
        _destroy(client, name, quiet=True)  # a clone that failed is removed by the daemon; be sure
        raise
    except BaseException:
        _destroy(client, name, quiet=True)  # interrupted: the daemon may finish the clone anyway
        raise
    try:
        result = _measure(client, name, hot_mib, progress)
    except BaseException:
        _destroy(client, name, quiet=True)  # the measurement's error is the one to report
        raise
    _destroy(client, name, quiet=False)
    return result


def _destroy(client: Client, name: str, *, quiet: bool) -> None:
    try:
        client.destroy(name)
    except SandboxNotFound:
        return
    except AzqemuError as exc:
        if not quiet:
            raise
        log.error("cannot destroy %s: %s", name, exc)


def host_idle() -> dict[str, str]:
    """The host's cpuidle driver and halt-polling setting (see the module docstring)."""
    out = {}
    for key, path in (("cpuidle_driver", "/sys/devices/system/cpu/cpuidle/current_driver"),
                      ("guest_halt_poll_ns", "/sys/module/haltpoll/parameters/guest_halt_poll_ns")):
        try:
            with open(path) as f:
                out[key] = f.read().strip()
        except OSError:
            out[key] = ""
    return out


def _delta_faults(before: dict[str, Any], after: dict[str, Any]) -> int:
    return int(after["handler"]["faults"]) - int(before["handler"]["faults"])


def _spin(before: dict[str, Any], after: dict[str, Any], faults: int) -> dict[str, float]:
    """What the C fault thread's spin after a fault (config.fault_spin_us) did between two
    readings: fault batches it caught without sleeping, and the time it spun (on a CPU, unless
    preempted meanwhile)."""
    b, a = before["handler"].get("spin", {}), after["handler"].get("spin", {})
    caught, spun_s = a.get("caught", 0) - b.get("caught", 0), a.get("s", 0.0) - b.get("s", 0.0)
    return {"caught": caught, "spun_s": spun_s, "spun_us_per_fault": spun_s * 1e6 / faults if faults else 0.0}


def _measure(c: Client, name: str, hot_mib: int, progress: Callable[[str], None]) -> dict[str, Any]:
    ws = GuestWorkingSet(c, name)
    alloc_s = ws.start(hot_mib)
    progress(f"working set of {hot_mib} MiB filled in the guest in {alloc_s:.1f} s")
    warm = ws.tool_call()
    progress(f"warm tool call: {warm['duration_s']:.2f} s")

    # 1. Resume without prefetch: every page of the working set faults.
    comp1 = c.compress(name).as_json()
    progress(f"compressed: {comp1['stored_pages']} pages stored of {comp1['resident_pages']} resident")
    res_nopf = c.resume(name, prefetch=False).as_json()
    m0 = c.memstats(name, reset=True).as_json()
    call_nopf = ws.tool_call()
    m1 = c.memstats(name, reset=True).as_json()
    faults_without = _delta_faults(m0, m1)
    progress(f"tool call after a resume without prefetch: {faults_without} faults, "
             f"{call_nopf['duration_s']:.2f} s")

    # 2. Compress again (hot set: what call 1 faulted in), resume with prefetch.
    comp2 = c.compress(name).as_json()
    t0 = time.perf_counter()
    res_pf = c.resume(name, prefetch=True).as_json()
    resume_rtt_s = time.perf_counter() - t0
    m2 = c.memstats(name, reset=True).as_json()
    call_pf = ws.tool_call()
    m3 = c.memstats(name).as_json()
    faults_with = _delta_faults(m2, m3)
    progress(f"tool call after a resume with prefetch: {faults_with} faults, {call_pf['duration_s']:.2f} s")

    # 3. The cycle after: its hot set is what call 2 faulted in. Whether prefetch holds up
    # cycle after cycle depends on the hot set keeping the pages call 2 used without faulting.
    comp3 = c.compress(name).as_json()
    res_next = c.resume(name, prefetch=True).as_json()
    m4 = c.memstats(name, reset=True).as_json()
    call_next = ws.tool_call()
    m5 = c.memstats(name).as_json()
    faults_next = _delta_faults(m4, m5)
    progress(f"tool call in the next cycle (prefetch): {faults_next} faults, {call_next['duration_s']:.2f} s")

    with contextlib.suppress(AzqemuError):
        ws._sh(f"echo quit > {GUEST_DIR}/in && cat {GUEST_DIR}/out")

    service = m1["service_us"]
    stall = call_nopf["stall_ns"]
    page_mib = 4096 / 2**20
    prefetched = int(res_pf.get("prefetched_pages", 0))
    return {
        "fault_service_us": {"median": service.get("median", 0.0), "p99": service.get("p99", 0.0),
                             "min": service.get("min", 0.0), "p90": service.get("p90", 0.0),
                             "max": service.get("max", 0.0),
                             "samples": service["samples"], "method": "host: fault message read to UFFDIO_COPY done"},
        "fault_spin": _spin(m0, m1, faults_without),
        "fault_stall_us": {"median": stall["median"] / 1e3, "p99": stall["p99"] / 1e3,
                           "p10": stall["p10"] / 1e3, "p90": stall["p90"] / 1e3, "max": stall["max"] / 1e3,
                           "pages": call_nopf["pages"],
                           "method": "guest: first touch minus resident touch (median), per page",
                           "first_touch_us": {k: v / 1e3 for k, v in call_nopf["first_ns"].items()},
                           "resident_touch_us": {k: v / 1e3 for k, v in call_nopf["resident_ns"].items()},
                           "clocksource": call_nopf["clocksource"]},
        "prefetch_mib_s": float(res_pf.get("prefetch_mib_s", 0.0)),
        "prefetch_s": float(res_pf.get("prefetch_s", 0.0)),
        "prefetch_decode_s": float(m2["last_resume"].get("decode_s", 0.0)),
        "prefetch_copy_s": float(m2["last_resume"].get("copy_s", 0.0)),
        "prefetched_pages": prefetched,
        "prefetched_mib": prefetched * page_mib,
        "resume_s": float(res_pf["resume_s"]),
        "resume_rtt_s": resume_rtt_s,
        "resume_without_prefetch_s": float(res_nopf["resume_s"]),
        "hot_mib": hot_mib,
        "hot_set_mib": int(comp2["hot_pages"]) * page_mib,
        "faults_after_resume": {"with_prefetch": faults_with, "without_prefetch": faults_without},
        "faults_removed_fraction": (1.0 - faults_with / faults_without) if faults_without else 0.0,
        "tool_call_s": {"warm": warm["duration_s"], "without_prefetch": call_nopf["duration_s"],
                        "with_prefetch": call_pf["duration_s"]},
        "touch_pass_s": {"without_prefetch": call_nopf["first_pass_s"],
                         "with_prefetch": call_pf["first_pass_s"], "resident": call_nopf["resident_pass_s"]},
        "fault_stall_with_prefetch_us": {"median": call_pf["stall_ns"]["median"] / 1e3,
                                         "p99": call_pf["stall_ns"]["p99"] / 1e3},
        "compress": {"stored_pages": int(comp2["stored_pages"]), "resident_pages": int(comp2["resident_pages"]),
                     "total_s": float(comp2["total_s"]), "pages_by_kind": comp2.get("pages", {})},
        "next_cycle": {"hot_set_mib": int(comp3["hot_pages"]) * page_mib,
                       "prefetched_pages": int(res_next.get("prefetched_pages", 0)),
                       "faults_with_prefetch": faults_next, "tool_call_s": call_next["duration_s"]},
        "handler_errors": int(m5["handler"]["errors"]),
        "host_idle": host_idle(),
        "sandbox": name,
    }


def _get(result: dict[str, Any], key: str) -> float:
    v: Any = result
    for part in key.split("."):
        v = v[part]
    return float(v)


def targets_met(result: dict[str, Any]) -> dict[str, bool]:
    out = {}
    for key, (bound, kind) in (TARGETS | (CONCURRENT_TARGETS if "concurrent" in result else {})).items():
        v = _get(result, key)
        out[key] = v <= bound if kind == "max" else v >= bound
    return out


def format_table(result: dict[str, Any]) -> str:
    met = targets_met(result)
    fa = result["faults_after_resume"]
    rows: list[tuple[str, str, str]] = [
        ("fault_service_us.median", "fault service median (us, host)", f"{result['fault_service_us']['median']:.1f}"),
        ("fault_service_us.p99", "fault service p99 (us, host)", f"{result['fault_service_us']['p99']:.1f}"),
        ("fault_stall_us.median", "fault stall median (us, guest)", f"{result['fault_stall_us']['median']:.1f}"),
        ("fault_stall_us.p99", "fault stall p99 (us, guest)", f"{result['fault_stall_us']['p99']:.1f}"),
        ("fault_spin", "spin after a fault (us a fault, host)",
         f"{result['fault_spin']['spun_us_per_fault']:.1f}" if "fault_spin" in result else "-"),
        ("prefetch_mib_s", "prefetch (MiB/s)", f"{result['prefetch_mib_s']:.0f}"),
        ("resume_s", f"resume, {result['hot_set_mib']:.0f} MiB hot set (ms)", f"{result['resume_s'] * 1e3:.1f}"),
        ("faults_after_resume.without_prefetch", "faults in tool call, no prefetch", f"{fa['without_prefetch']}"),
        ("faults_after_resume.with_prefetch", "faults in tool call, prefetch", f"{fa['with_prefetch']}"),
        ("faults_removed_fraction", "faults removed by prefetch (%)", f"{result['faults_removed_fraction'] * 100:.1f}"),
    ]
    if "next_cycle" in result:
        rows.append(("next_cycle", "faults in tool call, next cycle", f"{result['next_cycle']['faults_with_prefetch']}"))
    if "concurrent" in result:
        rows += _concurrent_rows(result["concurrent"])
    targets = TARGETS | CONCURRENT_TARGETS
    lines = [f"{'figure':<36} {'measured':>10}  {'target':<10} verdict"]
    for key, label, value in rows:
        if key in targets:
            bound, kind = targets[key]
            shown = bound * 1e3 if key == "resume_s" else bound * 100 if key == "faults_removed_fraction" else bound
            target = f"{'<=' if kind == 'max' else '>='} {shown:g}"
            verdict = "met" if met[key] else "NOT met"
        else:
            target, verdict = "", ""
        lines.append(f"{label:<36} {value:>10}  {target:<10} {verdict}".rstrip())
    return "\n".join(lines)


def _concurrent_rows(conc: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Table lines of ``--concurrent N`` (restore_concurrent.py): (target key, label, value)."""
    n, svc = conc["sandboxes"], conc["fault_service_us"]
    return [("concurrent.fault_service_us.median", f"fault service median, {n} at once (us)", f"{svc['median']:.1f}"),
            ("concurrent.fault_service_us.p99", f"fault service p99, {n} at once (us)", f"{svc['p99']:.1f}"),
            ("concurrent.overlap", f"all {n} faulting at once (% of span)",
             f"{100 * conc['overlap_s'] / conc['span_s']:.0f}" if conc.get("span_s") else "-")]
