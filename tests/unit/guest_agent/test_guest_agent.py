"""The in-guest phase reporter (guest-agent/) and its host-side reader (azqemu.sched.agent_channel).

The reporter is exercised for real on this host (a pty stands in for the virtio-serial port,
a process renamed ``qemu-ga`` for qemu-ga); the reader is fed hostile input, which only a fake
guest can produce. Every line the real reporter writes must pass the reader: that is the
contract between the two ends.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import textwrap
import time
import tty
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from azqemu.sched import agent_channel as ac
from azqemu.sched.agent_channel import AgentChannel, encode_command

AGENT_DIR = Path(__file__).resolve().parents[3] / "guest-agent"
_spec = importlib.util.spec_from_file_location("azq_guest_agent", AGENT_DIR / "azq_guest_agent.py")
assert _spec is not None and _spec.loader is not None
ga = importlib.util.module_from_spec(_spec)
sys.modules["azq_guest_agent"] = ga
_spec.loader.exec_module(ga)


def line(**kw: object) -> bytes:
    msg: dict[str, object] = {"v": 1, "seq": 0, "t": 1.5, "event": "idle", "phase": "wait", "tools": 0}
    msg.update(kw)
    msg = {k: v for k, v in msg.items() if v is not ...}
    return json.dumps(msg).encode() + b"\n"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------
# Host-side reader: valid messages
# ---------------------------------------------------------------------------------------

def test_valid_messages_of_every_event() -> None:
    ch = AgentChannel("sb-1")
    data = b"".join([
        line(seq=0, event="hello", phase="tool", agent="azq-guest-agent/1", pid=1, tools=...),
        line(seq=1, event="tool-start", phase="tool", pid=812, comm="python3", source="guest-exec", tools=...),
        line(seq=2, event="busy", phase="tool", tools=1, runnable=2),
        line(seq=3, event="tool-end", phase="wait", pid=812, comm="python3", source="guest-exec",
             duration_s=1.25, tools=...),
        line(seq=4, event="idle", phase="wait", tools=0, idle_s=0.6),
        line(seq=5, event="hint", phase="tool", source="azq-phase", pid=99, tools=...),
        line(seq=6, event="state", phase="wait", tools=0, idle=True),
        line(seq=7, event="clock", phase="wait", tools=..., set=True, skew_ms=-12.5),
        line(seq=8, event="clock", phase="tool", tools=..., set=True, skew_ms=3_600_000),
    ])
    msgs = ch.feed(data)
    assert [m.event for m in msgs] == ["hello", "tool-start", "busy", "tool-end", "idle", "hint", "state",
                                       "clock", "clock"]
    assert all(m.sandbox == "sb-1" for m in msgs)
    assert msgs[1].pid == 812 and msgs[1].comm == "python3" and msgs[1].source == "guest-exec"
    assert msgs[3].duration_s == 1.25 and msgs[3].phase == "wait"
    assert msgs[7].set is True and msgs[7].skew_ms == -12.5
    assert ch.stats.accepted == 9 and ch.stats.seq_gaps == 0
    assert ch.stats.clock_steps == 2 and ch.stats.clock_skew_ms_last == 3_600_000


def test_partial_lines_are_reassembled() -> None:
    ch = AgentChannel("sb")
    data = line(seq=0) + line(seq=1)
    out = []
    for i in range(len(data)):
        out += ch.feed(data[i:i + 1])
    assert [m.seq for m in out] == [0, 1]


def test_seq_gaps_and_resets_are_counted_not_rejected() -> None:
    ch = AgentChannel("sb")
    ch.feed(line(seq=0) + line(seq=5) + line(seq=2, event="hello", phase="tool", agent="x", tools=...))
    assert ch.stats.accepted == 3 and ch.stats.seq_gaps == 4 and ch.stats.seq_resets == 1


def test_guest_side_drop_count_is_recorded() -> None:
    ch = AgentChannel("sb")
    (msg,) = ch.feed(line(dropped=7))
    assert msg.dropped == 7 and ch.stats.guest_dropped == 7


# ---------------------------------------------------------------------------------------
# Host-side reader: malicious input
# ---------------------------------------------------------------------------------------

def test_huge_line_is_dropped_and_buffer_stays_bounded() -> None:
    ch = AgentChannel("sb")
    for _ in range(64):                     # 64 MiB without a newline
        assert ch.feed(b"A" * (1 << 20)) == []
        assert len(ch._buf) <= ac.MAX_LINE_BYTES
    msgs = ch.feed(b"tail of the huge line\n" + line(seq=1))
    assert [m.seq for m in msgs] == [1]     # the next line after the huge one is read normally
    assert ch.stats.dropped_long == 1 and ch.stats.accepted == 1


def test_line_just_over_the_bound_is_dropped() -> None:
    ch = AgentChannel("sb", max_line_bytes=100)
    padded = line(seq=0)[:-1] + b" " * (101 - len(line(seq=0)) + 1) + b"\n"
    assert ch.feed(padded) == []
    assert ch.stats.dropped_long == 1
    assert len(ch.feed(line(seq=1))) == 1


def test_flood_is_rate_limited_per_sandbox() -> None:
    clock = Clock()
    noisy = AgentChannel("noisy", clock=clock)
    quiet = AgentChannel("quiet", clock=clock)
    msgs = noisy.feed(b"".join(line(seq=i) for i in range(10_000)))
    assert len(msgs) == ac.BURST
    assert noisy.stats.dropped_rate == 10_000 - ac.BURST
    # The other sandbox's bucket is untouched.
    assert len(quiet.feed(line(seq=0))) == 1
    # Tokens come back with time, at the configured rate.
    clock.now += 1.0
    assert len(noisy.feed(b"".join(line(seq=20_000 + i) for i in range(100)))) == int(ac.RATE_PER_S)


def test_garbage_lines_cost_tokens_too() -> None:
    ch = AgentChannel("sb", clock=Clock())
    ch.feed(b"not json\n" * 1000)
    assert ch.stats.rejected_json == ac.BURST and ch.stats.dropped_rate == 1000 - ac.BURST


@pytest.mark.parametrize("raw, counter", [
    (b"{not json}\n", "rejected_json"),
    (b"\xff\xfe\x00garbage\n", "rejected_json"),
    (b'{"v":1,"seq":0,"t":1,"event":"idle","phase":"wait","tools":0}\x00\n', "rejected_json"),
    (b"[" * 4000 + b"\n", "rejected_json"),
    (b'{"v":1,"seq":0,"t":NaN,"event":"idle","phase":"wait","tools":0}\n', "rejected_json"),
    (b'{"v":1,"seq":0,"t":Infinity,"event":"idle","phase":"wait","tools":0}\n', "rejected_json"),
    (b'{"v":1,"v":1,"seq":0,"t":1,"event":"idle","phase":"wait","tools":0}\n', "rejected_json"),
    (b"42\n", "rejected_schema"),
    (b'"idle"\n', "rejected_schema"),
    (b"null\n", "rejected_schema"),
])
def test_bad_json_is_rejected(raw: bytes, counter: str) -> None:
    ch = AgentChannel("sb")
    assert ch.feed(raw) == []
    assert getattr(ch.stats, counter) == 1, ch.stats
    assert ch.stats.accepted == 0


@pytest.mark.parametrize("kw, reason", [
    ({"event": "compress-neighbour"}, "unknown event"),
    ({"event": ["idle"]}, "unknown event"),
    ({"sandbox": "other-sb"}, "unknown field(s) sandbox"),
    ({"domain": "other-sb"}, "unknown field(s) domain"),
    ({"target": "other-sb", "name": "x"}, "unknown field(s) name, target"),
    ({"tools": ...}, "missing field(s) tools"),
    ({"seq": ...}, "missing field(s) seq"),
    ({"v": 2}, "unsupported protocol version"),
    ({"v": True}, "v must be an integer in [0, 65536]"),
    ({"seq": -1}, "seq must be an integer"),
    ({"seq": 2**64}, "seq must be an integer"),
    ({"seq": 1.0}, "seq must be an integer"),
    ({"seq": "1"}, "seq must be an integer"),
    ({"t": -1}, "t must be a number"),
    ({"t": 1e300}, "t must be a number"),
    ({"t": "now"}, "t must be a number"),
    ({"t": True}, "t must be a number"),
    ({"phase": "tool"}, "phase must be one of wait"),
    ({"phase": "compress"}, "phase must be one of wait"),
    ({"tools": True}, "tools must be an integer"),
    ({"tools": {"n": 1}}, "tools must be an integer"),
    ({"idle_s": [1]}, "idle_s must be a number"),
    ({"event": "tool-start", "phase": "tool", "tools": ..., "pid": 0, "comm": "x", "source": "hint"},
     "pid must be an integer"),
    ({"event": "tool-start", "phase": "tool", "tools": ..., "pid": 10, "comm": "x" * 65, "source": "hint"},
     "comm must be a string"),
    ({"event": "tool-start", "phase": "tool", "tools": ..., "pid": 10, "comm": "a\x00b", "source": "hint"},
     "comm holds control characters"),
    ({"event": "tool-start", "phase": "tool", "tools": ..., "pid": 10, "comm": "a\nb", "source": "hint"},
     "comm holds control characters"),
    ({"event": "tool-start", "phase": "tool", "tools": ..., "pid": 10, "comm": "x", "source": "host"},
     "source must be one of guest-exec, hint"),
    ({"event": "tool-start", "phase": "wait", "tools": ..., "pid": 10, "comm": "x", "source": "hint"},
     "phase must be one of tool"),
    ({"event": "state", "phase": "wait", "tools": 0, "idle": False}, "state: idle contradicts phase"),
    ({"event": "state", "phase": "wait", "tools": 0, "idle": 1}, "idle must be a boolean"),
    ({"event": "clock", "tools": ..., "set": 1, "skew_ms": 0}, "set must be a boolean"),
    ({"event": "clock", "tools": ..., "set": True, "skew_ms": 1e13}, "skew_ms must be a number"),
    ({"event": "clock", "tools": ..., "set": True, "skew_ms": "5"}, "skew_ms must be a number"),
    ({"event": "clock", "tools": ..., "set": True}, "missing field(s) skew_ms"),
])
def test_schema_violations_are_rejected_with_reason(kw: dict, reason: str) -> None:
    ch = AgentChannel("sb")
    assert ch.feed(line(**kw)) == []
    assert ch.stats.rejected_schema == 1
    assert ch.stats.last_reject.startswith(reason), ch.stats.last_reject


def test_a_message_can_only_concern_its_own_channel() -> None:
    a, b = AgentChannel("sb-a"), AgentChannel("sb-b")
    # A guest that tries to speak for another sandbox is rejected outright ...
    assert a.feed(line(sandbox="sb-b")) == []
    # ... and whatever it sends that is accepted is attributed to its own channel.
    (msg,) = a.feed(line(seq=1))
    assert msg.sandbox == "sb-a"
    assert not hasattr(msg, "target")
    assert b.stats.lines == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=6000))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    ch = AgentChannel("sb", max_line_bytes=512)
    for msg in ch.feed(data):
        assert msg.sandbox == "sb" and msg.event in ac.EVENTS
    assert len(ch._buf) <= 512


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "seq", "t", "event", "phase", "tools", "pid", "comm",
                                        "source", "idle", "idle_s", "sandbox", "x"]),
                       st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                 st.text(max_size=80), st.lists(st.integers(), max_size=3))))
def test_arbitrary_objects_never_raise(obj: dict) -> None:
    ch = AgentChannel("sb")
    for msg in ch.feed(json.dumps(obj).encode() + b"\n"):
        assert msg.sandbox == "sb" and "sandbox" not in obj


def test_encode_command() -> None:
    assert encode_command("state") == b'{"cmd":"state"}\n'
    assert encode_command("clock", realtime_ns=1_800_000_000_123_456_789) == \
        b'{"cmd":"clock","realtime_ns":1800000000123456789}\n'
    for bad in (("rm -rf", {}), ("clock", {}), ("state", {"realtime_ns": 1})):
        with pytest.raises(ValueError):
            encode_command(bad[0], **bad[1])


# ---------------------------------------------------------------------------------------
# The reporter's pieces
# ---------------------------------------------------------------------------------------

def test_parse_stat_with_hostile_comm() -> None:
    text = "1234 (a) (b c) S 1 1234 1234 0 -1 4194560 100 0 0 0 7 3 5 6 20 0 1 0 5555 0 0"
    p = ga.parse_stat(text)
    assert p is not None
    assert (p.pid, p.comm, p.state, p.ppid, p.ticks, p.child_ticks, p.starttime) == \
        (1234, "a) (b c", "S", 1, 10, 11, 5555)
    assert ga.parse_stat("garbage") is None


def test_parse_stat_of_this_process() -> None:
    p = ga.parse_stat(Path(f"/proc/{os.getpid()}/stat").read_text())
    assert p is not None and p.pid == os.getpid() and p.ppid == os.getppid() and not p.is_kernel


def P(pid: int, comm: str, state: str = "S", ppid: int = 1, ticks: int = 0, child_ticks: int = 0,
      start: int = 1, flags: int = 0) -> object:
    return ga.Proc(pid, comm, state, ppid, flags, ticks, child_ticks, start)


def procs(*ps: object) -> dict:
    return {p.pid: p for p in ps}  # type: ignore[attr-defined]


def test_detector_tool_lifecycle_and_idle() -> None:
    d = ga.Detector(self_pid=50, idle_scans=3)
    base = [P(1, "init"), P(2, "kthreadd", ppid=0), P(10, "qemu-ga"), P(50, "python3", "R", ticks=999),
            P(3, "kworker/0:1", "R", ppid=2, flags=ga.PF_KTHREAD)]
    ev = d.step(procs(*base), 0.0)
    assert [e["event"] for e in ev] == []               # own R state and kernel threads ignored
    ev = d.step(procs(*base), 0.2) + d.step(procs(*base), 0.4)
    assert [e["event"] for e in ev] == ["idle"]
    assert d.idle
    # A guest-exec child appears and runs.
    ev = d.step(procs(*base, P(20, "python3", "R", ppid=10, ticks=5, start=77)), 1.0)
    assert [e["event"] for e in ev] == ["tool-start", "busy"]
    assert ev[0] == {"event": "tool-start", "phase": "tool", "pid": 20, "comm": "python3",
                     "source": "guest-exec"}
    # It sleeps (a tool waiting on the network is not runnable): idle again after 3 scans.
    ev = []
    for i in range(3):
        ev += d.step(procs(*base, P(20, "python3", "S", ppid=10, ticks=5, start=77)), 1.2 + 0.2 * i)
    assert [e["event"] for e in ev] == ["idle"] and ev[0]["tools"] == 1
    # It ends: tool-end with its duration; qemu-ga reaped it with 30 ticks -> busy.
    ev = d.step(procs(*base[:2], P(10, "qemu-ga", child_ticks=30), *base[3:]), 2.0)
    assert [e["event"] for e in ev] == ["tool-end", "busy"]
    assert ev[0]["duration_s"] == 1.0 and ev[0]["phase"] == "wait"


def test_detector_pid_reuse_is_a_new_tool() -> None:
    d = ga.Detector(self_pid=50)
    d.step(procs(P(10, "qemu-ga"), P(20, "sh", ppid=10, start=5)), 0.0)
    ev = d.step(procs(P(10, "qemu-ga"), P(20, "sh", ppid=10, start=9)), 0.2)
    assert [e["event"] for e in ev if e["event"].startswith("tool")] == ["tool-end", "tool-start"]


def test_detector_short_tool_between_scans_counts_as_busy() -> None:
    d = ga.Detector(self_pid=50, idle_scans=1)
    assert d.step(procs(P(10, "qemu-ga", child_ticks=0)), 0.0)[0]["event"] == "idle"
    assert d.step(procs(P(10, "qemu-ga", child_ticks=1)), 0.2) == []
    ev = d.step(procs(P(10, "qemu-ga", child_ticks=1 + ga.BUSY_TICKS_PER_SCAN)), 0.4)
    assert [e["event"] for e in ev] == ["busy"]


def test_detector_hint_marked_process_is_a_tool() -> None:
    d = ga.Detector(self_pid=50)
    d.mark(33, 0.0)
    ev = d.step(procs(P(33, "make", "S")), 0.1)
    assert ev[0]["event"] == "tool-start" and ev[0]["source"] == "hint"
    ev = d.step(procs(), 0.5)
    assert ev[0]["event"] == "tool-end" and ev[0]["source"] == "hint" and 33 not in d.marked


def test_detector_in_guest_agent_must_wait_on_a_tcp_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    d = ga.Detector(self_pid=50, agent_comms=("claude",), idle_scans=1)
    monkeypatch.setattr(ga, "established_tcp_inodes", lambda root: {"777"})
    sockets = {60: set()}
    monkeypatch.setattr(ga, "socket_inodes", lambda pid, root: sockets[pid])
    agent = P(60, "claude", "S")
    ev = d.step(procs(agent), 0.0)
    assert [e["event"] for e in ev] == ["busy"]         # no LLM connection: thinking locally
    sockets[60] = {"777"}
    ev = d.step(procs(agent), 0.4)
    assert [e["event"] for e in ev] == ["idle"]         # blocked on its LLM connection
    ev = d.step(procs(P(60, "claude", "R")), 0.6)
    assert [e["event"] for e in ev] == ["busy"]


# ---------------------------------------------------------------------------------------
# The real reporter, end to end on this host
# ---------------------------------------------------------------------------------------

FAKE_QEMU_GA = textwrap.dedent("""
    import ctypes, shlex, subprocess, sys, threading
    ctypes.CDLL(None).prctl(15, b"qemu-ga", 0, 0, 0)   # PR_SET_NAME: comm becomes qemu-ga
    children = []
    def reap():
        import time
        while True:
            for c in list(children):
                if c.poll() is not None:
                    children.remove(c)
            time.sleep(0.05)
    threading.Thread(target=reap, daemon=True).start()
    for cmd in sys.stdin:
        children.append(subprocess.Popen(shlex.split(cmd)))
""")


class PtyReader:
    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.lines = fd, b"", []

    def read_until(self, pred, timeout_s: float = 15.0) -> list[dict]:
        """Read messages until one satisfies pred; return all read so far."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, raw in enumerate(self.lines):
                if pred(json.loads(raw)):
                    got, self.lines = self.lines[:i + 1], self.lines[i + 1:]
                    return [json.loads(x) for x in got]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out; got {self.lines}")
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                self.buf += os.read(self.fd, 65536)
                *complete, self.buf = self.buf.split(b"\n")
                self.lines += complete


@pytest.fixture(params=[pytest.param("proc-events", marks=pytest.mark.root), "scan-only"])
def running_agent(request, tmp_path: Path):
    master, slave = os.openpty()
    tty.setraw(slave)
    port = os.ttyname(slave)
    fake_ga = subprocess.Popen([sys.executable, "-c", FAKE_QEMU_GA], stdin=subprocess.PIPE, text=True)
    sock = tmp_path / "agent.sock"
    mode = request.param
    if mode == "proc-events" and os.geteuid() != 0:
        pytest.skip("the process events connector needs CAP_NET_ADMIN")
    # --no-set-clock: this host's clock is not the reporter's to step (a guest's is).
    extra = ["--no-set-clock"] + (["--no-proc-events"] if mode == "scan-only" else [])
    agent = subprocess.Popen([sys.executable, str(AGENT_DIR / "azq_guest_agent.py"), "--port", port,
                              "--hint-socket", str(sock), "--scope-pid", str(fake_ga.pid), *extra],
                             stderr=subprocess.PIPE, text=True)
    try:
        yield PtyReader(master), master, fake_ga, sock, mode
    finally:
        agent.terminate()
        fake_ga.kill()
        agent.wait(10)
        assert agent.stderr is not None
        assert agent.stderr.read() == ""        # no fallback warning, no traceback
        fake_ga.wait(10)
        os.close(master)
        os.close(slave)


def test_reporter_end_to_end(running_agent) -> None:
    reader, master, fake_ga, sock, mode = running_agent
    ch = AgentChannel("sb-e2e", rate_per_s=1000, burst=1000)
    seen: list[dict] = []

    def until(pred):
        got = reader.read_until(pred)
        seen.extend(got)
        return got

    hello = until(lambda m: m["event"] == "hello")[-1]
    assert hello["agent"] == ga.AGENT_NAME
    until(lambda m: m["event"] == "idle")
    # A guest-exec'd tool: a child of "qemu-ga" that computes for ~1 s.
    fake_ga.stdin.write(f"{sys.executable} -c 'import time; t = time.time(); "
                       "any(iter(lambda: time.time() - t > 2, True))'\n")
    fake_ga.stdin.flush()
    got = until(lambda m: m["event"] == "tool-end")
    events = [m["event"] for m in got]
    assert "tool-start" in events and "busy" in events
    start = next(m for m in got if m["event"] == "tool-start")
    assert start["source"] == "guest-exec" and start["phase"] == "tool"
    assert 1.5 <= got[-1]["duration_s"] <= 6
    until(lambda m: m["event"] == "idle")
    if mode == "proc-events":
        # A tool far shorter than a scan interval still gets its start and end, named by the
        # command it exec'd, with its real duration.
        fake_ga.stdin.write("true\n")
        fake_ga.stdin.flush()
        got = until(lambda m: m["event"] == "tool-end" and m["comm"] == "true")
        start = next(m for m in got if m["event"] == "tool-start")
        assert start["comm"] == "true" and start["source"] == "guest-exec"
        assert got[-1]["duration_s"] < 0.5
    # Explicit hints through the azq-phase script, forwarded with the sender's pid.
    env = dict(os.environ, AZQ_AGENT_SOCKET=str(sock))
    hinter = subprocess.run([str(AGENT_DIR / "azq-phase"), "wait"], env=env)
    assert hinter.returncode == 0
    hint = until(lambda m: m["event"] == "hint")[-1]
    assert hint["phase"] == "wait" and hint["source"] == "azq-phase" and hint["pid"] > 0
    # azq-phase run: the exec'd command keeps the pid and is reported as a tool.
    run = subprocess.Popen([str(AGENT_DIR / "azq-phase"), "run", "--", "sleep", "0.8"], env=env)
    got = until(lambda m: m["event"] == "tool-end" and m["source"] == "hint")
    assert run.wait(10) == 0
    starts = [m for m in got if m["event"] == "tool-start"]
    assert starts and starts[0]["pid"] == run.pid and starts[0]["source"] == "hint"
    hints = [m for m in got if m["event"] == "hint"]
    assert hints and hints[0]["pid"] == run.pid and hints[0]["phase"] == "tool"
    # The host asks for the state.
    os.write(master, encode_command("state"))
    state = until(lambda m: m["event"] == "state")[-1]
    assert state["tools"] == 0
    # The host sends its wall clock (here 5 s ahead of ours): the reporter answers with the
    # step it would make. A time no host has (year 1970) is ignored, not answered.
    os.write(master, b'{"cmd":"clock","realtime_ns":5}\n')
    os.write(master, encode_command("clock", realtime_ns=time.time_ns() + 5_000_000_000))
    clocks = [m for m in until(lambda m: m["event"] == "clock") if m["event"] == "clock"]
    assert len(clocks) == 1 and clocks[0]["set"] is False
    assert 4_000 < clocks[0]["skew_ms"] <= 5_000
    # Every line the reporter wrote passes the host reader, in order.
    msgs = ch.feed(b"".join(json.dumps(m).encode() + b"\n" for m in seen))
    assert len(msgs) == len(seen), ch.stats
    assert [m.seq for m in msgs] == sorted(m.seq for m in msgs)
    assert ch.stats.seq_gaps == 0


def test_azq_phase_without_agent_fails_cleanly(tmp_path: Path) -> None:
    env = dict(os.environ, AZQ_AGENT_SOCKET=str(tmp_path / "nobody.sock"))
    r = subprocess.run([str(AGENT_DIR / "azq-phase"), "tool"], env=env, capture_output=True, text=True)
    assert r.returncode == 3 and r.stderr.startswith("azq-phase: no guest agent at")
    r = subprocess.run([str(AGENT_DIR / "azq-phase"), "run", "--", "true"], env=env, capture_output=True)
    assert r.returncode == 0                             # the command still runs
    r = subprocess.run([str(AGENT_DIR / "azq-phase"), "bogus"], env=env, capture_output=True)
    assert r.returncode == 2


def test_reporter_missing_port_is_one_line() -> None:
    r = subprocess.run([sys.executable, str(AGENT_DIR / "azq_guest_agent.py"), "--port", "/nonexistent/port",
                        "--hint-socket", ""], capture_output=True, text=True, timeout=20)
    assert r.returncode == 1
    assert r.stderr.strip() == "azq-guest-agent: cannot open /nonexistent/port: No such file or directory"


def test_scan_is_cheap_and_skips_kernel_threads() -> None:
    sc = ga.Scanner()
    first = sc.scan()
    assert os.getpid() in first and all(not p.is_kernel for p in first.values())
    assert 2 in sc.kthreads                          # kthreadd, remembered and not re-read
    t0 = time.process_time()
    for _ in range(20):
        sc.scan()
    per_scan_s = (time.process_time() - t0) / 20
    n = len(first)
    # A minbase guest has ~10 user processes: at 5 Hz a scan must stay a small share of a
    # CPU. The bound is loose on purpose (CPU time of a shared host's process still varies
    # with cache pressure); it catches a scan that rereads every kernel thread, not drift.
    assert per_scan_s / max(n, 1) * 30 < 0.01, (per_scan_s, n)


def test_detector_zombie_tool_has_ended() -> None:
    d = ga.Detector(self_pid=50)
    d.step(procs(P(10, "qemu-ga"), P(20, "sh", ppid=10)), 0.0)
    ev = d.step(procs(P(10, "qemu-ga"), P(20, "sh", "Z", ppid=10)), 0.2)
    assert ev[0]["event"] == "tool-end"


def test_detector_process_events() -> None:
    d = ga.Detector(self_pid=50)
    d.step(procs(P(10, "qemu-ga")), 0.0)
    d.on_fork(parent_tgid=10, child_pid=20, child_tgid=20, t=1.0)
    d.on_fork(parent_tgid=10, child_pid=21, child_tgid=10, t=1.0)       # a thread of qemu-ga
    d.on_fork(parent_tgid=99, child_pid=22, child_tgid=22, t=1.0)       # not qemu-ga's
    assert d.forked == {20: 1.0}
    # A scan between fork and exec does not name the tool "qemu-ga".
    assert [e["event"] for e in d.step(procs(P(10, "qemu-ga"), P(20, "qemu-ga", ppid=10)), 1.01)
            if e["event"].startswith("tool")] == []
    ev = d.on_exec(20, 1.02, proc_root="/nonexistent")                 # gone before we looked
    assert ev == [{"event": "tool-start", "phase": "tool", "pid": 20, "comm": "?", "source": "guest-exec"}]
    assert d.on_exec(22, 1.02) == []
    ev = d.on_exit(20, 20, 1.5)
    assert ev[0]["event"] == "tool-end" and ev[0]["duration_s"] == 0.5 and ev[0]["phase"] == "wait"
    assert d.on_exit(20, 20, 1.6) == [] and d.tools == {}
    # A hint-marked pid is a tool from its exec on.
    d.mark(30, 2.0)
    assert d.on_exec(30, 2.1, proc_root="/nonexistent")[0]["source"] == "hint"
    assert d.on_exit(30, 30, 2.4)[0]["duration_s"] == 0.3


def test_detector_reaped_cpu_is_not_counted_twice() -> None:
    d = ga.Detector(self_pid=50, idle_scans=1)
    sh = P(30, "sh", "S", ticks=1)
    assert [e["event"] for e in d.step(procs(sh, P(31, "python3", "S", ppid=30, ticks=40)), 0.0)] == ["idle"]
    # The child dies and the shell reaps it: cutime grows by the 40 ticks already counted.
    assert d.step(procs(P(30, "sh", "S", ticks=1, child_ticks=40)), 0.2) == []
    # A child that lived and died unseen between two scans does make the guest busy.
    ev = d.step(procs(P(30, "sh", "S", ticks=1, child_ticks=70)), 0.4)
    assert [e["event"] for e in ev] == ["busy"]


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="the process events connector needs CAP_NET_ADMIN")
def test_proc_events_connector() -> None:
    pe = ga.ProcEvents()
    try:
        t0 = time.monotonic()
        child = subprocess.Popen(["/bin/true"])
        child.wait()
        seen = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len(seen) < 3:
            select.select([pe.sock], [], [], 0.5)
            for what, t, f in pe.read():
                pid = f[2] if what == pe.FORK else f[0]
                if pid == child.pid:
                    seen.setdefault(what, (t, f))
        assert set(seen) == {pe.FORK, pe.EXEC, pe.EXIT}
        fork_t, fork = seen[pe.FORK]
        assert fork[1] == os.getpid() and fork[3] == child.pid          # parent tgid, child tgid
        assert t0 - 0.5 < fork_t <= seen[pe.EXIT][0] < time.monotonic()  # CLOCK_MONOTONIC
        assert seen[pe.EXIT][1][1] == child.pid
    finally:
        pe.close()


def test_exec_of_a_known_tool_renames_it(tmp_path: Path) -> None:
    d = ga.Detector(self_pid=50)
    d.mark(40, 0.0)
    d.step(procs(P(40, "python3")), 0.1)                  # azq-phase, before its exec
    (tmp_path / "40").mkdir()
    (tmp_path / "40" / "comm").write_text("sleep\n")
    assert d.on_exec(40, 0.2, proc_root=str(tmp_path)) == []
    assert d.on_exit(40, 40, 1.1)[0]["comm"] == "sleep"
