"""The pure parts of azq bench restore: the guest program compiles, targets and the table."""

from __future__ import annotations

from azqemu.bench import restore_bench as rb


def _result(**over: object) -> dict[str, object]:
    res: dict[str, object] = {
        "fault_service_us": {"median": 7.5, "p99": 120.0},
        "fault_stall_us": {"median": 30.0, "p99": 90.0},
        "prefetch_mib_s": 3100.0, "resume_s": 0.2, "hot_set_mib": 110.0,
        "faults_after_resume": {"with_prefetch": 40, "without_prefetch": 28000},
        "faults_removed_fraction": 1 - 40 / 28000,
    }
    res.update(over)
    return res


def test_guest_program_is_valid_python() -> None:
    compile(rb.GUEST_PROGRAM, "ws.py", "exec")


def test_targets_met_reads_bounds_both_ways() -> None:
    met = rb.targets_met(_result())
    assert met == {"fault_service_us.median": True, "fault_service_us.p99": False,
                   "fault_stall_us.median": True, "prefetch_mib_s": True, "resume_s": False,
                   "faults_removed_fraction": True}


def test_table_shows_units_targets_and_verdicts() -> None:
    lines = rb.format_table(_result()).splitlines()
    assert lines[0].split() == ["figure", "measured", "target", "verdict"]
    resume = next(line for line in lines if line.startswith("resume, 110 MiB hot set (ms)"))
    assert resume.split()[-5:] == ["200.0", "<=", "50", "NOT", "met"]
    removed = next(line for line in lines if line.startswith("faults removed by prefetch (%)"))
    assert removed.split()[-4:] == ["99.9", ">=", "90", "met"]
    stall_p99 = next(line for line in lines if line.startswith("fault stall p99"))
    assert stall_p99.split()[-1] == "90.0"  # no target: no verdict
    assert not any(line.startswith("faults in tool call, next cycle") for line in lines)


def test_table_shows_the_next_cycle_when_measured() -> None:
    res = _result(next_cycle={"faults_with_prefetch": 27950})
    assert rb.format_table(res).splitlines()[-1].split()[-1] == "27950"


def test_table_shows_the_spin_per_fault() -> None:
    def spin_line(res: dict[str, object]) -> str:
        return next(line for line in rb.format_table(res).splitlines() if line.startswith("spin after a fault"))
    assert spin_line(_result(fault_spin={"caught": 900, "spun_s": 0.42, "spun_us_per_fault": 15.0})).split()[-1] == "15.0"
    assert spin_line(_result()).split()[-1] == "-"      # a daemon that does not report it
