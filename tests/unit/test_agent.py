"""The guest agent client against replies a real qemu-ga does not send: a malicious or broken
guest's. Each is one AgentError (never a crash of the caller), and a streamed exec still
kills its command and closes its files on the way out. The real agent's behaviour (output
while the command runs, exit codes, the cap) is tested in tests/integration/test_exec_stream.py."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest

from azqemu import agent as agent_mod
from azqemu.agent import GuestAgent
from azqemu.errors import AgentError, AgentTimeout, ExecError

Reply = Callable[[dict[str, Any]], Any]


@pytest.fixture(autouse=True)
def quick_reap(monkeypatch: pytest.MonkeyPatch) -> None:
    # These guests never report the killed command's exit: do not wait for it long.
    monkeypatch.setattr(agent_mod, "REAP_S", 0.05)


class HostileAgent:
    """A transport that answers like qemu-ga, except where a test overrides a command."""

    def __init__(self, **overrides: Reply | str) -> None:
        self.overrides = overrides
        self.sent: list[dict[str, Any]] = []
        self.next_handle = 1000

    def __call__(self, command_json: str, _timeout_s: int) -> str:
        msg = json.loads(command_json)
        self.sent.append(msg)
        name, args = msg["execute"], msg.get("arguments", {})
        o = self.overrides.get(name.replace("-", "_"))
        if isinstance(o, str):
            return o                       # a raw reply, not even JSON perhaps
        if o is not None:
            return json.dumps({"return": o(args)})
        return json.dumps({"return": self.honest(name, args)})

    def honest(self, name: str, args: dict[str, Any]) -> Any:
        if name == "guest-file-open":
            self.next_handle += 1
            return self.next_handle
        if name == "guest-exec":
            return {"pid": 42}
        if name == "guest-exec-status":
            return {"exited": True, "exitcode": 0}
        if name == "guest-file-read":
            return {"count": 0, "buf-b64": "", "eof": True}
        return {}

    def called(self, name: str) -> list[dict[str, Any]]:
        return [m.get("arguments", {}) for m in self.sent if m["execute"] == name]


def streamed(t: HostileAgent, timeout_s: float = 5.0) -> tuple[list[tuple[str, bytes]], Any]:
    got: list[tuple[str, bytes]] = []
    res = GuestAgent("evil", t).exec(["echo", "hi"], timeout_s=timeout_s, on_output=lambda s, d: got.append((s, d)))
    return got, res


def test_an_honest_exit_is_read_to_the_end_and_the_files_closed() -> None:
    chunks = iter([{"count": 3, "buf-b64": base64.b64encode(b"hi\n").decode(), "eof": True}])
    t = HostileAgent(guest_file_read=lambda a: next(chunks, {"count": 0, "buf-b64": "", "eof": True}))
    got, res = streamed(t)
    assert got == [("stdout", b"hi\n")] and res.exit_code == 0 and res.stdout == b""
    assert sorted(a["handle"] for a in t.called("guest-file-close")) == [1001, 1002]
    (run,) = [a for a in t.called("guest-exec") if a["path"] == "/bin/sh"]
    out, err = run["arg"][3:5]
    assert out.startswith("/run/azq-exec.") and out.endswith(".out") and err == out[:-4] + ".err"
    assert run["arg"][5:] == ["echo", "hi"]
    assert not [a for a in t.called("guest-exec") if a["path"] == "/bin/rm"]   # the wrapper unlinked them


@pytest.mark.parametrize("reply", [
    {"count": 5, "buf-b64": "not base64!", "eof": False},
    {"count": 9, "buf-b64": base64.b64encode(b"hi").decode(), "eof": False},         # count lies
    {"count": agent_mod.STREAM_CHUNK_BYTES + 1, "buf-b64": "", "eof": False},        # more than asked
    {"count": 1, "buf-b64": "A" * (agent_mod.STREAM_CHUNK_BYTES * 2), "eof": False},  # a huge buffer
    {"count": "3", "buf-b64": "aGkK"},
    {"count": True, "buf-b64": ""},
    {"count": 3, "buf-b64": ["aGkK"]},
    ["not", "a", "dict"],
    None,
])
def test_a_malformed_read_is_one_agent_error_and_the_command_is_killed(reply: Any) -> None:
    t = HostileAgent(guest_file_read=lambda a: reply, guest_exec_status=lambda a: {"exited": False})
    with pytest.raises(AgentError, match="malformed guest-file-read reply"):
        streamed(t)
    assert any(a["path"] == "/bin/sh" and a["arg"][-2:] == ["azq-kill", "42"] for a in t.called("guest-exec"))
    assert len(t.called("guest-file-close")) == 2
    assert [a for a in t.called("guest-exec") if a["path"] == "/bin/rm"]   # cleanup: the files go


@pytest.mark.parametrize("override", [
    {"guest_exec": lambda a: {"pid": "42"}},
    {"guest_exec": lambda a: {"pid": -1}},
    {"guest_exec": lambda a: "pid"},
    {"guest_exec_status": lambda a: {"exited": "yes"}},
    {"guest_exec_status": lambda a: {"exited": True, "exitcode": 10 ** 9}},
    {"guest_exec_status": lambda a: {"exited": True, "exitcode": 0, "err-data": 7}},
    {"guest_exec_status": lambda a: {"exited": True, "exitcode": 0, "out-data": "%%%"}},
    {"guest_exec_status": "this is not JSON"},
    {"guest_exec_status": "[" * 100000 + "]" * 100000},
    {"guest_exec_status": json.dumps([1, 2])},
    {"guest_file_open": lambda a: "a handle"},
])
def test_malformed_exec_replies_are_agent_errors_both_ways(override: dict[str, Any]) -> None:
    for stream in (False, True) if "guest_file_open" not in override else (True,):
        t = HostileAgent(**override)
        with pytest.raises(AgentError):
            if stream:
                streamed(t)
            else:
                GuestAgent("evil", t).exec(["true"], timeout_s=5)


def test_an_error_reply_keeps_its_class_and_a_bounded_message() -> None:
    t = HostileAgent(guest_exec=json.dumps({"error": {"class": "X" * 10000, "desc": "d" * 10000}}))
    with pytest.raises(ExecError) as exc:
        GuestAgent("evil", t).exec(["true"], timeout_s=5)
    assert exc.value.error_class is not None and len(exc.value.error_class) <= 100 and len(str(exc.value)) < 700


def test_a_guest_that_never_exits_times_out_killed_and_cleaned() -> None:
    t = HostileAgent(guest_exec_status=lambda a: {"exited": False})
    with pytest.raises(AgentTimeout):
        streamed(t, timeout_s=0.3)
    assert any(a["arg"][-2:] == ["azq-kill", "42"] for a in t.called("guest-exec"))
    assert len(t.called("guest-file-close")) == 2


def test_a_guest_that_writes_without_end_is_stopped_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    from azqemu.errors import PayloadTooLarge

    monkeypatch.setattr(agent_mod, "MAX_STREAM_OUTPUT_BYTES", 3 * agent_mod.STREAM_CHUNK_BYTES + 10)
    full = {"count": agent_mod.STREAM_CHUNK_BYTES,
            "buf-b64": base64.b64encode(b"y" * agent_mod.STREAM_CHUNK_BYTES).decode(), "eof": False}
    t = HostileAgent(guest_file_read=lambda a: full, guest_exec_status=lambda a: {"exited": False})
    got: list[tuple[str, bytes]] = []
    with pytest.raises(PayloadTooLarge) as exc:
        GuestAgent("evil", t).exec(["yes"], timeout_s=30, on_output=lambda s, d: got.append((s, d)))
    assert exc.value.limit_bytes == agent_mod.MAX_STREAM_OUTPUT_BYTES
    assert sum(len(d) for _, d in got) == agent_mod.MAX_STREAM_OUTPUT_BYTES   # up to the cap, not past it
    assert any(a["arg"][-2:] == ["azq-kill", "42"] for a in t.called("guest-exec"))


def test_a_sink_that_fails_stops_the_command() -> None:
    chunk = {"count": 2, "buf-b64": base64.b64encode(b"hi").decode(), "eof": False}
    t = HostileAgent(guest_file_read=lambda a: chunk, guest_exec_status=lambda a: {"exited": False})

    def gone(_s: str, _d: bytes) -> None:
        raise BrokenPipeError("the client left")

    with pytest.raises(BrokenPipeError):
        GuestAgent("evil", t).exec(["yes"], timeout_s=30, on_output=gone)
    assert any(a["arg"][-2:] == ["azq-kill", "42"] for a in t.called("guest-exec"))
    assert len(t.called("guest-file-close")) == 2


def test_a_wrapper_that_cannot_start_the_command_is_an_exec_error() -> None:
    said = base64.b64encode(b"azq-exec: /no/such: No such file or directory\n").decode()
    t = HostileAgent(guest_exec_status=lambda a: {"exited": True, "exitcode": 127, "err-data": said})
    with pytest.raises(ExecError, match="cannot run 'echo' in 'evil': /no/such: No such file or directory"):
        streamed(t)
    t = HostileAgent(guest_exec_status=lambda a: {"exited": True, "exitcode": 2, "err-data": said})
    with pytest.raises(AgentError, match="exec wrapper failed"):
        streamed(t)


class SlowCommand(HostileAgent):
    """qemu-ga running a command that exits after ``exits_after`` status calls."""

    def __init__(self, exits_after: int) -> None:
        super().__init__(guest_exec_status=self._status)
        self.exits_after = exits_after

    def _status(self, _args: dict[str, Any]) -> dict[str, Any]:
        done = len(self.called("guest-exec-status")) > self.exits_after
        return {"exited": True, "exitcode": 3} if done else {"exited": False}


def test_with_an_exit_watch_the_status_is_asked_when_the_end_is_reported() -> None:
    """Told the command ended, exec asks the status then (fast, until qemu-ga agrees), not
    every 50 ms while it runs; the result is qemu-ga's."""
    t = SlowCommand(exits_after=5)
    waits: list[tuple[int, float]] = []

    def exit_wait(pid: int, timeout_s: float) -> bool | None:
        waits.append((pid, timeout_s))
        return True
    res = GuestAgent("g", t).exec(["sleep", "9"], exit_wait=exit_wait)
    assert res.exit_code == 3
    assert waits == [(42, agent_mod.EXIT_WAIT_POLL_S)]    # once, after the first fast polls
    assert len(t.called("guest-exec-status")) == 6


def test_without_word_from_the_agent_exec_polls_as_before() -> None:
    t = SlowCommand(exits_after=8)
    res = GuestAgent("g", t).exec(["sleep", "9"], exit_wait=lambda pid, s: None)
    assert res.exit_code == 3 and len(t.called("guest-exec-status")) == 9


def test_a_lost_end_report_costs_one_status_call_per_wait() -> None:
    """The agent saw the start but its end report never comes: the status is asked after each
    wait, and exec ends when qemu-ga says so."""
    t = SlowCommand(exits_after=6)
    waits: list[int] = []
    res = GuestAgent("g", t).exec(["sleep", "9"], exit_wait=lambda pid, s: waits.append(pid) and None or False)
    assert res.exit_code == 3
    # Four fast polls (2, 4, 8 ms apart), then one status call per wait.
    assert len(t.called("guest-exec-status")) == 7 and len(waits) == 3
