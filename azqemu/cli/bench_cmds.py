"""``azq bench``: benchmarks that print figures (JSON and a table), never pass/fail."""

from __future__ import annotations

import json
import time

import click

from azqemu.api.models import DEFAULT_GRACE_S
from azqemu.cli.output import emit, json_option
from azqemu.client import Client
from azqemu.daemon.proc import ensure_daemon

BENCH_TEMPLATE = "azq-bench"
# One policy's own grace in a density run or sweep (density.parse_policy_graces reads them).
policy_grace_option = click.option(
    "--policy-grace", "policy_graces", multiple=True, metavar="POLICY=SECONDS",
    help="This policy's grace instead of --grace (repeatable): each baseline as its operator would tune it, "
         "e.g. linux=1.0.")


@click.group()
def bench() -> None:
    """Benchmarks (clone, restore, density, capacity, nightly, api)."""


def ensure_template(c: Client, name: str, mem_mib: int = 512) -> None:
    if not any(t.name == name for t in c.template_list()):
        c.template_create(name, mem_mib=mem_mib, vcpus=1, warmup=["cd /workspace/* && python3 -m unittest -q"])


@bench.command("clone")
@click.option("-n", "count", default=16, show_default=True, type=int)
@click.option("--template", "template_name", default=BENCH_TEMPLATE, show_default=True,
              help="Template to clone (made from the guest image if missing).")
@click.option("--mode", "ram_mode", type=click.Choice(["auto", "eager", "lazy"]), default="auto")
@json_option
def bench_clone(count: int, template_name: str, ram_mode: str, as_json: bool) -> None:
    """Clone N sandboxes at once: per-clone time (start to guest agent answering) and total."""
    from azqemu.bench.clone_bench import run_clone

    with ensure_daemon():
        c = Client()
        ensure_template(c, template_name)
        result = run_clone(c, template_name, count, ram_mode)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(f"{'clones':>8} {'median s':>9} {'p95 s':>7} {'total s':>8} mode")
        click.echo(f"{result['clones']:>8} {result['per_clone_s']['median']:>9.3f} "
                   f"{result['per_clone_s']['p95']:>7.3f} {result['total_s']:>8.2f} {result['ram_mode']}")


@bench.command("restore")
@click.option("--hot-mib", default=100, show_default=True, type=click.IntRange(min=1),
              help="Working set the repeated tool call touches (the hot set of the resume).")
@click.option("--template", "template_name", default=None,
              help=f"Template to clone (made from the guest image if missing) [default: {BENCH_TEMPLATE}; "
                   "the concurrent sandboxes: a 256 MiB one].")
@click.option("--concurrent", "concurrent", default=None, type=click.IntRange(min=1),
              help="Then also N sandboxes faulting at once: compressed, resumed without prefetch, "
                   "their working sets touched together; fault service pooled over every handler.")
@click.option("--concurrent-hot-mib", default=None, type=click.IntRange(min=1),
              help="Working set of each concurrent sandbox [default: 16].")
@json_option
def bench_restore(hot_mib: int, template_name: str | None, concurrent: int | None,
                  concurrent_hot_mib: int | None, as_json: bool) -> None:
    """Compress and resume a lazy clone around a repeated tool call: per-fault service time,
    the guest's stall per fault, prefetch throughput, resume time, faults removed by prefetch."""
    from azqemu.bench import restore_bench, restore_concurrent

    def progress(msg: str) -> None:
        if not as_json:
            click.echo(msg, err=True)

    with ensure_daemon():
        c = Client()
        ensure_template(c, template_name or BENCH_TEMPLATE)
        result = restore_bench.run(c, template=template_name or BENCH_TEMPLATE, hot_mib=hot_mib,
                                   progress=progress)
        if concurrent is not None:
            small = template_name or restore_concurrent.CONCURRENT_TEMPLATE
            if template_name is None:
                ensure_template(c, small, mem_mib=restore_concurrent.CONCURRENT_MEM_MIB)
            result["concurrent"] = restore_concurrent.run(
                c, template=small, sandboxes=concurrent,
                hot_mib=concurrent_hot_mib or restore_concurrent.DEFAULT_CONCURRENT_HOT_MIB, progress=progress)
    result["targets_met"] = restore_bench.targets_met(result)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(restore_bench.format_table(result))


@bench.command("api")
@click.option("-c", "--clients", default=8, show_default=True, type=click.IntRange(1, 256),
              help="Concurrent clients, each with its own connection.")
@click.option("-d", "--duration", "duration_s", default=5.0, show_default=True,
              type=click.FloatRange(0.1, 600.0), help="Seconds of load (after 0.5 s of warm-up).")
@click.option("--sandbox", default=None,
              help="Whose dominfo and domstats to call [default: the first sandbox listed; none if there is none].")
@json_option
def bench_api(clients: int, duration_s: float, sandbox: str | None, as_json: bool) -> None:
    """The API's own latency under load: N clients of cheap calls (ping, the sandbox and template
    lists, a sandbox's dominfo and domstats) against the running daemon; requests/s, latency
    median/p95/p99 per route, errors."""
    from azqemu.bench import api_bench

    result = api_bench.run(clients=clients, duration_s=duration_s, sandbox=sandbox,
                           progress=None if as_json else _progress)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(api_bench.table(result))


def _progress(msg: str) -> None:
    click.echo(f"[{time.strftime('%H:%M:%S')}] {msg}", err=True)


@bench.command("density")
@click.option("--workload", "workload_name", default="coding-agent", show_default=True,
              help="A built-in workload (coding-agent, data-processing, random-data, long-lived-heap, "
                   "long-tools, many-small-files, service-agent) or a workload file.")
@click.option("--sandboxes", "-n", default=16, show_default=True, type=int)
@click.option("--policy", "policies", multiple=True,
              help="Policy to run (repeatable; default: none, none-cow, linux, agentzip).")
@click.option("--scale", default="full", show_default=True, help="Workload scale: full or small.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--grace", "grace_s", default=DEFAULT_GRACE_S, show_default=True, type=float,
              help="Seconds of LLM wait before a policy compresses or reclaims.")
@policy_grace_option
@click.option("--rounds", "round_count", default=1, show_default=True, type=click.IntRange(1, 20),
              help="Run every policy this many times, the order reversed every other round (A-B-B-A): "
                   "the figures are the rounds' means, and each figure's range over the rounds is printed.")
@click.option("--out", "out_dir", default=None, help="Directory for JSON, markdown and PNG plots.")
@json_option
def bench_density(workload_name: str, sandboxes: int, policies: tuple[str, ...], scale: str, seed: int,
                  grace_s: float, policy_graces: tuple[str, ...], round_count: int, out_dir: str | None,
                  as_json: bool) -> None:
    """Run one workload under each policy, side by side on this host, and compare memory and latency."""
    from pathlib import Path

    from azqemu.bench import density, report
    from azqemu.bench.workload import load

    wl = load(workload_name)
    pols = list(policies) or list(density.DEFAULT_POLICIES)
    graces = density.parse_policy_graces(policy_graces, pols)
    with ensure_daemon():
        result = density.run_density(wl, sandboxes, pols, seed=seed, scale=scale, grace_s=grace_s,
                                     grace_by_policy=graces, round_count=round_count, progress=_progress)
    out = Path(out_dir or f"results/density-{time.strftime('%Y%m%d-%H%M%S')}")
    files = report.write_report(result, out)
    diffs = density.outputs_identical(result)
    if as_json:
        click.echo(report.to_json(report.with_ratios(result)))
    else:
        report.print_table(result)
        click.echo(f"written: {files.json}, {files.markdown}"
                   + "".join(f", {p}" for p in (files.memory_png, files.latency_png) if p))
    for d in diffs:
        click.echo(f"azq: warning: {d}", err=True)


@bench.command("capacity")
@click.option("--workload", "workload_name", default="coding-agent", show_default=True,
              help="A built-in workload or a workload file.")
@click.option("--fanouts", default="4,8,16", show_default=True,
              help="Fan-outs to run, smallest first (at least two).")
@click.option("--policy", "policies", multiple=True,
              help="Policy to run (repeatable; default: none, none-cow, linux, agentzip).")
@click.option("--budget", default="auto", show_default=True,
              help="Memory budget: bytes, a size (16G, 512M) or auto (MemAvailable at start).")
@click.option("--scale", default="full", show_default=True, help="Workload scale: full or small.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--grace", "grace_s", default=DEFAULT_GRACE_S, show_default=True, type=float,
              help="Seconds of LLM wait before a policy compresses or reclaims.")
@policy_grace_option
@click.option("--out", "out_dir", default=None, help="Directory for JSON, markdown and the PNG plot.")
@json_option
@click.option("--from", "from_dir", default=None,
              help="Fit again from an earlier sweep's --out directory (its density-nN.json): run nothing.")
def bench_capacity(workload_name: str, fanouts: str, policies: tuple[str, ...], budget: str, scale: str,
                   seed: int, grace_s: float, policy_graces: tuple[str, ...], out_dir: str | None, as_json: bool,
                   from_dir: str | None) -> None:
    """Run the density benchmark at increasing fan-outs, fit host cost = fixed + marginal x N per
    policy, and say how many sandboxes fit in the budget (on host cost, and with QEMU's own memory)."""
    from pathlib import Path

    from azqemu.bench import capacity, density, report
    from azqemu.bench.workload import load

    wl = load(workload_name)
    ns = capacity.parse_fanouts(fanouts)
    budget_bytes = capacity.parse_budget(budget)
    pols = list(policies) or list(density.DEFAULT_POLICIES)
    graces = density.parse_policy_graces(policy_graces, pols)
    out = Path(out_dir or f"results/capacity-{time.strftime('%Y%m%d-%H%M%S')}")

    def keep(n: int, result: dict) -> None:
        report.write_report(result, out, prefix=f"density-n{n}")

    if from_dir:
        result = capacity.refit(Path(from_dir), budget_bytes)
        out = Path(out_dir or from_dir)
    else:
        with ensure_daemon():
            result = capacity.run_capacity(wl, ns, pols, budget_bytes=budget_bytes, seed=seed, scale=scale,
                                           grace_s=grace_s, grace_by_policy=graces, progress=_progress,
                                           on_density=keep)
    files = capacity.write_report(result, out)
    if as_json:
        click.echo(capacity.to_json(result), nl=False)
    else:
        capacity.print_table(result)
        click.echo(f"written: {files.json}, {files.markdown}" + (f", {files.png}" if files.png else ""))
    failed = {p: v["failed_steps"] for p, v in result["policies"].items() if v.get("failed_steps")}
    if failed:
        click.echo(f"azq: warning: failed steps {failed}", err=True)
    for w in capacity.warnings(result):
        click.echo(f"azq: warning: {w}", err=True)


@bench.command("fill")
@click.option("--workload", "workload_name", default="coding-agent", show_default=True,
              help="A built-in workload or a workload file.")
@click.option("--policy", "policies", multiple=True,
              help="Policy to fill with (repeatable; default: none-cow, linux, agentzip).")
@click.option("--budget", default="1G", show_default=True,
              help="The memory cgroup's limit: bytes, a size (4G, 512M) or auto (MemAvailable at start).")
@click.option("--step", default=2, show_default=True, type=int, help="Sandboxes added per window.")
@click.option("--max-sandboxes", default=32, show_default=True, type=int)
@click.option("--window", "window_s", default=30.0, show_default=True, type=float,
              help="Seconds of tool calls timed after each addition.")
@click.option("--slowdown", default=1.5, show_default=True, type=float,
              help="Latency bound: the window's median tool call over the first window's.")
@click.option("--scale", default="small", show_default=True, help="Workload scale: full or small.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--grace", "grace_s", default=DEFAULT_GRACE_S, show_default=True, type=float)
@click.option("--capacity", "capacity_file", default=None,
              help="A capacity sweep's capacity.json: its fit's prediction for this budget, beside the fill.")
@click.option("--out", "out_dir", default=None, help="Directory for fill.json and fill.md.")
@json_option
def bench_fill(workload_name: str, policies: tuple[str, ...], budget: str, step: int, max_sandboxes: int,
               window_s: float, slowdown: float, scale: str, seed: int, grace_s: float, capacity_file: str | None,
               out_dir: str | None, as_json: bool) -> None:
    """Fill a memory cgroup (the manager and every QEMU) with sandboxes until an OOM kill, a
    failure or the latency bound: how many fit, beside what the capacity fit predicts."""
    from pathlib import Path

    from azqemu.bench import capacity, fill
    from azqemu.bench.workload import load
    from azqemu.errors import ConfigError

    wl = load(workload_name)
    budget_bytes = capacity.parse_budget(budget) or capacity.mem_available_bytes()
    cap = None
    if capacity_file:
        try:
            cap = json.loads(Path(capacity_file).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the capacity result {capacity_file}: {exc}") from exc
    with ensure_daemon():
        result = fill.run_fill(wl, list(policies) or list(fill.DEFAULT_POLICIES), budget_bytes, step=step,
                               max_sandboxes=max_sandboxes, window_s=window_s, slowdown=slowdown, seed=seed,
                               scale=scale, grace_s=grace_s, capacity=cap, progress=_progress)
    out = Path(out_dir or f"results/fill-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fill.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "fill.md").write_text(fill.table(result) + "\n")
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        click.echo(fill.table(result))
        click.echo(f"written: {out / 'fill.json'}, {out / 'fill.md'}")


@bench.command("nightly")
@click.option("--results", "results_dir", default=None,
              help="Directory of the history and the dated run directories [default: $AZQ_STATE_DIR/nightly].")
@click.option("--workload", "workloads", multiple=True,
              help="Workload to run (repeatable; default: every built-in one).")
@click.option("--sandboxes", "-n", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("--scale", default="full", show_default=True, help="Workload scale: full or small.")
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--grace", "grace_s", default=DEFAULT_GRACE_S, show_default=True, type=float,
              help="Seconds of LLM wait before a policy compresses or reclaims.")
@click.option("--policy", "policies", multiple=True,
              help="Policy to run (repeatable; default: none, none-cow, linux, agentzip, agentzip-no-prefetch).")
@click.option("--clones", default=16, show_default=True, type=click.IntRange(min=1),
              help="Clones of the clone benchmark.")
@click.option("--clone-mode", type=click.Choice(["auto", "eager", "lazy"]), default="auto", show_default=True)
@click.option("--skip-clone", is_flag=True, help="Do not run the clone benchmark.")
@click.option("--hot-mib", default=100, show_default=True, type=click.IntRange(min=1),
              help="Working set of the restore benchmark.")
@click.option("--skip-restore", is_flag=True, help="Do not run the restore benchmark.")
@click.option("-k", "--baseline-runs", "k", default=5, show_default=True, type=click.IntRange(min=2),
              help="Baseline: the median of this many latest comparable runs.")
@click.option("--tolerance", default=None, type=click.FloatRange(min=0.0),
              help="Smallest relative worsening that counts, for every figure [default: per figure].")
@click.option("--all-figures", is_flag=True, help="List every compared figure, not only those out of band.")
@json_option
def bench_nightly(results_dir: str | None, workloads: tuple[str, ...], sandboxes: int, scale: str, seed: int,
                  grace_s: float, policies: tuple[str, ...], clones: int, clone_mode: str, skip_clone: bool,
                  hot_mib: int, skip_restore: bool, k: int, tolerance: float | None, all_figures: bool,
                  as_json: bool) -> None:
    """Run the density benchmark on each workload, the clone and the restore benchmark; append
    the figures to the history and compare them with the median of the last K comparable runs
    (exit 3 on a regression). Comparability is decided before the run; every run is recorded."""
    from pathlib import Path

    from azqemu import config
    from azqemu.bench import nightly, nightly_run
    from azqemu.bench.workload import builtin_names, load
    from azqemu.sched import policy as policy_mod

    opts = nightly.Options(workloads=workloads or tuple(builtin_names()), sandboxes=sandboxes, scale=scale,
                           seed=seed, grace_s=grace_s, policies=policies or nightly.NIGHTLY_POLICIES,
                           clones=None if skip_clone else clones, clone_mode=clone_mode,
                           restore_hot_mib=None if skip_restore else hot_mib, k=k, tolerance=tolerance)
    for p in opts.policies:
        policy_mod.get(p)       # a bad name is a usage error now, not a failed run later
    wls = [load(w) for w in opts.workloads]
    root = Path(results_dir) if results_dir else config.load().state_dir / "nightly"
    history, warnings = nightly.read_history(root / nightly.HISTORY_NAME)
    for w in warnings:
        click.echo(f"azq: warning: {w}", err=True)
    planned = nightly.planned_record(opts, wls, nightly.host_context())
    baselines = nightly.plan_baselines(history, planned, opts.k)
    _progress(f"{len(history)} earlier runs in {root / nightly.HISTORY_NAME}; this run: "
              f"{planned['host']}, {planned['accelerator']}, commit {planned['commit']}")
    for b in baselines.values():
        _progress(b.describe())
    run_dir = root / planned["run_id"]

    def bench_template() -> str:
        ensure_template(Client(), BENCH_TEMPLATE)
        return BENCH_TEMPLATE

    with ensure_daemon():
        out = nightly_run.run(Client(), planned, wls, opts, run_dir, bench_template=bench_template,
                              progress=_progress)
    outcome = nightly_run.finish(root, out, baselines, history_warnings=warnings, tolerance=opts.tolerance,
                                 run_dir=run_dir)
    if as_json:
        emit(outcome.as_json())
    else:
        click.echo(nightly_run.format_comparisons(outcome, all_rows=all_figures))
        click.echo(f"recorded in {outcome.history_file}; written: {', '.join(out.files) or 'no result'}; "
                   f"{len(outcome.plots)} trend plots in {outcome.run_dir}")
        for r in outcome.regressions:
            click.echo(f"REGRESSION {r}")
    for e in outcome.errors:
        click.echo(f"azq: benchmark failed (recorded): {e}", err=True)
    if outcome.regressions:
        raise SystemExit(3)
    if outcome.errors:
        raise SystemExit(1)
