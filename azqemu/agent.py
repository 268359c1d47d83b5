"""A client of the QEMU guest agent (qemu-ga): explicit methods, no attribute magic.

It talks through a transport, a callable ``send(command_json, timeout_s) -> reply_json``; the
virt layer provides one over libvirt's agent channel (``Domain.agent_command``), which
serialises access and knows whether the agent's port is open. The agent may not be up yet
(a guest still booting, a clone just resumed): ``wait_ready`` retries ``guest-ping`` until a
deadline.

Everything the agent sends back comes from the guest and is untrusted: replies are checked
for shape, sizes are bounded, and a reply that does not fit is an ``AgentError``, never a crash.

Two ways to run a command. ``exec`` without ``on_output`` hands the command to ``guest-exec``
with its output captured by qemu-ga, which gives it over only once the command has exited.
With ``on_output`` the output is streamed while the command runs, through nothing but qemu-ga:
two files are created in the guest (``guest-file-open``, mode ``w+``, a random name under
``/run``), a small ``/bin/sh`` wrapper points the command's stdout and stderr at them, unlinks
their names (qemu-ga's handles and the command's descriptors keep the files) and ``exec``s the
command; the files are polled with ``guest-file-read`` while ``guest-exec-status`` says it
runs, and read to their end once it has exited.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from azqemu.errors import (
    AgentError,
    AgentTimeout,
    AzqemuError,
    DomainNotFound,
    DomainStateError,
    ExecError,
    PayloadTooLarge,
    VirtError,
)

log = logging.getLogger(__name__)

Transport = Callable[[str, int], str]
# Called with ("stdout" or "stderr", bytes) as output arrives; raising stops the command.
OutputSink = Callable[[str, bytes], None]
# (guest pid, timeout s) -> True: it ended; False: timed out; None: nobody watches it.
ExitWait = Callable[[int, float], "bool | None"]

# guest-exec-status is polled; start fast (short tool calls finish in milliseconds) and back
# off so that a long command does not keep the agent, and the vCPU, busy.
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05
# With an exit watch (exec's ``exit_wait``): the polls before it is used (2+4+8 ms: a short
# command is done by then), and how long one wait lasts before the status is asked anyway.
WAIT_FOR_EXIT_FROM_S = 0.016
EXIT_WAIT_POLL_S = 0.5
# libvirt's agent calls take whole seconds as their timeout.
CALL_TIMEOUT_S = 10
# How long exec waits for an agent that libvirt reported unresponsive before giving up.
AGENT_RETRY_S = 15.0
# How many times in a row a status query is asked again after the agent failed it.
STATUS_RETRIES = 3
# Output is captured by qemu-ga in guest memory; bound what we accept from an untrusted guest.
MAX_OUTPUT_BYTES = 16 << 20

# -- streamed exec -------------------------------------------------------------------------
# Each poll round asks for the exit status and reads both files: three agent calls, a few
# milliseconds each under KVM and 10-50 ms under TCG. Back off from fast (a short command's
# output at once) to STREAM_POLL_MAX_S, which is then how late a line can arrive.
STREAM_POLL_FIRST_S = 0.01
STREAM_POLL_MAX_S = 0.15
# One guest-file-read asks for at most this much (base64 in the reply: 4/3 of it) ...
STREAM_CHUNK_BYTES = 256 << 10
# ... and a round reads at most this many chunks of one file, so that the status is still
# asked (and the timeout checked) while a command writes faster than we read.
STREAM_CHUNKS_PER_ROUND = 16
# Everything one command may stream (stdout and stderr together), as the captured path's cap:
# past it the command is killed and the caller gets PayloadTooLarge.
MAX_STREAM_OUTPUT_BYTES = MAX_OUTPUT_BYTES
# Where the output files go: a root-only tmpfs in azqemu's guest image; /tmp if it is missing.
STREAM_DIRS = ("/run", "/tmp")
# What the wrapper itself may say on the captured channel (a command it cannot start).
MAX_WRAPPER_MESSAGE_BYTES = 4096
# After a kill (or the cleanup's rm), how long to wait for qemu-ga to report the exit, so
# that its table of children does not keep the entry.
REAP_S = 2.0
WRAPPER_NAME = "azq-exec"
# $1, $2: the output files (created by guest-file-open); then the command. Checked first, on
# the captured channel, so that a command that cannot start is ExecError as with plain
# guest-exec (126/127 for azq exec), not an exit code from the shell.
WRAPPER = r"""o=$1 e=$2; shift 2
case $1 in
*/*) [ -e "$1" ] || { echo "azq-exec: $1: No such file or directory" >&2; exit 127; }
     [ -f "$1" ] && [ -x "$1" ] || { echo "azq-exec: $1: Permission denied" >&2; exit 126; } ;;
*) command -v -- "$1" >/dev/null 2>&1 || { echo "azq-exec: $1: No such file or directory" >&2; exit 127; } ;;
esac
exec >>"$o" 2>>"$e"
rm -f -- "$o" "$e" 2>/dev/null
exec "$@"
"""

# $1: a guest pid. Stopped first, so that it starts nothing more while its children are found
# (pgrep -P, each in turn stopped), then killed from the leaves up.
KILL_TREE = ('k() { kill -STOP "$1" 2>/dev/null; for c in $(pgrep -P "$1"); do k "$c"; done; '
             'kill -9 "$1" 2>/dev/null; }; k "$1"')


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    signal: int | None = None


@dataclass
class _Tail:
    """One output file being followed: its qemu-ga handle and how far it has been read."""
    stream: str
    handle: int
    offset: int = 0


class GuestAgent:
    def __init__(self, domain_name: str, transport: Transport) -> None:
        self.domain_name = domain_name
        self._send = transport

    def call(self, command: str, timeout_s: int = CALL_TIMEOUT_S, **arguments: Any) -> Any:
        msg: dict[str, Any] = {"execute": command}
        if arguments:
            msg["arguments"] = arguments
        reply = self._send(json.dumps(msg), timeout_s)
        try:
            data = json.loads(reply)
        except (ValueError, RecursionError) as exc:
            raise AgentError(f"guest agent of {self.domain_name!r} sent invalid JSON") from exc
        if not isinstance(data, dict):
            raise AgentError(f"guest agent of {self.domain_name!r} sent a malformed reply")
        if "error" in data:
            err = data["error"] if isinstance(data["error"], dict) else {}
            raise ExecError(str(err.get("desc", "unknown agent error"))[:500], str(err.get("class", ""))[:100])
        return data.get("return")

    def ping(self, timeout_s: int = 2) -> None:
        self.call("guest-ping", timeout_s)

    def wait_ready(self, timeout_s: float) -> float:
        """Retry guest-ping until it answers; returns the seconds waited."""
        start = time.monotonic()
        deadline = start + timeout_s
        last = ""
        while True:
            try:
                self.ping(timeout_s=max(1, min(5, int(deadline - time.monotonic()) or 1)))
                return time.monotonic() - start
            except (DomainNotFound, DomainStateError):
                raise      # the domain is gone (destroyed meanwhile): no agent will answer
            except (AgentError, VirtError) as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                log.debug("agent of %s not ready: %s", self.domain_name, last)
                raise AgentTimeout(self.domain_name, timeout_s, "answer")
            time.sleep(0.05)

    def exec(self, argv: Sequence[str], *, timeout_s: float = 60.0, stdin: bytes | None = None,
             env: Sequence[str] | None = None, on_output: OutputSink | None = None,
             exit_wait: ExitWait | None = None) -> ExecResult:
        """Run ``argv`` in the guest and wait for it; its exit code is returned, not raised.

        ``exit_wait(pid, timeout_s)``: waits for another's word that the guest process ended
        (True), timed out (False), or cannot tell (None: the status is polled as without it);
        ``sched.exitwatch.ExitWatch.wait_exit``. Only when to ask the status depends on it.

        A command that cannot be started (not found, not executable) raises ExecError. On
        timeout the guest process is killed and AgentTimeout is raised. With ``on_output`` its
        stdout and stderr go to ``on_output`` while it runs (the result's are then empty);
        more than MAX_STREAM_OUTPUT_BYTES of them kill it and raise PayloadTooLarge.
        """
        if not argv:
            raise ExecError("empty command")
        if on_output is not None:
            return self._exec_streamed(argv, timeout_s=timeout_s, stdin=stdin, env=env, on_output=on_output)
        start = time.monotonic()
        pid = self._start(argv, self._exec_args(argv[0], list(argv[1:]), stdin, env))
        poll = POLL_FIRST_S
        told = False        # the in-guest agent reported the end: poll fast until qemu-ga agrees
        while True:
            st = self._status(pid)
            if st.get("exited"):
                break
            elapsed = time.monotonic() - start
            if elapsed > timeout_s:
                self._kill(pid)
                raise AgentTimeout(self.domain_name, timeout_s, f"finish {argv[0]!r}")
            if exit_wait is not None and not told and poll >= WAIT_FOR_EXIT_FROM_S:
                # Past the fast polls that catch short commands: wait for the agent's word.
                got = exit_wait(pid, min(EXIT_WAIT_POLL_S, max(0.0, timeout_s - elapsed)))
                if got:
                    told, poll = True, POLL_FIRST_S
                if got is not None:
                    continue
            time.sleep(poll)
            poll = min(poll * 2, POLL_MAX_S)
        out = _decode(st.get("out-data"))
        err = _decode(st.get("err-data"))
        code, sig = self._exit_of(st)
        return ExecResult(code, out, err, time.monotonic() - start, sig)

    # -- the pieces of exec ----------------------------------------------------------------
    @staticmethod
    def _exec_args(path: str, args: list[str], stdin: bytes | None, env: Sequence[str] | None) -> dict[str, Any]:
        out: dict[str, Any] = {"path": path, "arg": args, "capture-output": True}
        if stdin is not None:
            out["input-data"] = base64.b64encode(stdin).decode()
        if env is not None:
            out["env"] = list(env)
        return out

    def _start(self, argv: Sequence[str], args: dict[str, Any]) -> int:
        """guest-exec: the guest pid of the started command."""
        try:
            try:
                ret = self.call("guest-exec", **args)
            except ExecError:
                raise
            except AgentError:
                # libvirt answers "not responding" when its guest-sync handshake fails, before
                # the command is sent (seen right after a clone resumes): wait for the agent,
                # then send the command once more.
                self.wait_ready(AGENT_RETRY_S)
                ret = self.call("guest-exec", **args)
        except ExecError as exc:
            raise ExecError(f"cannot run {argv[0]!r} in {self.domain_name!r}: {exc}", exc.error_class) from exc
        return self._int(ret, "pid", "guest-exec")

    def _status(self, pid: int) -> dict[str, Any]:
        """guest-exec-status, asked again after an agent that did not answer (it is idempotent),
        a few times in a row at most: an agent that answers pings but never this is broken."""
        for attempt in range(STATUS_RETRIES + 1):
            try:
                st = self.call("guest-exec-status", pid=pid)
            except ExecError:
                raise
            except AgentError:
                if attempt == STATUS_RETRIES:
                    raise
                self.wait_ready(AGENT_RETRY_S)
                continue
            if not isinstance(st, dict) or not isinstance(st.get("exited", False), bool):
                raise self._malformed("guest-exec-status")
            return st
        raise AssertionError("unreachable")

    def _exit_of(self, st: dict[str, Any]) -> tuple[int, int | None]:
        code, sig = st.get("exitcode"), st.get("signal")
        for v in (code, sig):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 255):
                raise self._malformed("guest-exec-status")
        return (128 + (sig or 0) if code is None else code), sig

    def _kill(self, pid: int) -> None:
        """SIGKILL ``pid`` and everything it started (a shell's children would run on)."""
        try:
            ret = self.call("guest-exec", path="/bin/sh", arg=["-c", KILL_TREE, "azq-kill", str(pid)])
        except AgentError:
            log.warning("could not kill guest pid %d in %s", pid, self.domain_name)
            return
        with contextlib.suppress(AgentError):
            self._reap(self._int(ret, "pid", "guest-exec"))

    def _int(self, ret: Any, key: str, what: str) -> int:
        v = ret.get(key) if isinstance(ret, dict) else None
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
            raise self._malformed(what)
        return v

    def _malformed(self, what: str) -> AgentError:
        return AgentError(f"guest agent of {self.domain_name!r} sent a malformed {what} reply")

    # -- streamed exec ---------------------------------------------------------------------
    def _exec_streamed(self, argv: Sequence[str], *, timeout_s: float, stdin: bytes | None,
                       env: Sequence[str] | None, on_output: OutputSink) -> ExecResult:
        start = time.monotonic()
        tails: list[_Tail] = []
        paths: tuple[str, str] = ("", "")
        pid: int | None = None
        exited = clean = False
        try:
            paths, tails = self._open_outputs()
            pid = self._start(argv, self._exec_args("/bin/sh", ["-c", WRAPPER, WRAPPER_NAME, *paths, *argv],
                                                    stdin, env))
            total = 0
            poll = STREAM_POLL_FIRST_S
            while True:
                st = self._status(pid)
                exited = bool(st.get("exited"))
                for t in tails:
                    total = self._follow(t, on_output, total, argv[0], to_end=exited)
                if exited:
                    break
                if time.monotonic() - start > timeout_s:
                    raise AgentTimeout(self.domain_name, timeout_s, f"finish {argv[0]!r}")
                time.sleep(poll)
                poll = min(poll * 2, STREAM_POLL_MAX_S)
            code, sig = self._exit_of(st)
            said = (_decode(st.get("out-data"), MAX_WRAPPER_MESSAGE_BYTES)
                    + _decode(st.get("err-data"), MAX_WRAPPER_MESSAGE_BYTES)).decode(errors="replace").strip()
            if said:
                # The command's own output never reaches the captured channel (the wrapper moved
                # it to the files first): anything there is the wrapper's.
                msg = said.splitlines()[-1][:500]
                if msg.startswith(WRAPPER_NAME + ": ") and code in (126, 127):
                    raise ExecError(f"cannot run {argv[0]!r} in {self.domain_name!r}: {msg[len(WRAPPER_NAME) + 2:]}")
                raise AgentError(f"azqemu's exec wrapper failed in {self.domain_name!r} (exit {code}): {msg}")
            clean = True
            return ExecResult(code, b"", b"", time.monotonic() - start, sig)
        finally:
            if pid is not None and not exited:
                # Timed out, past the cap, the caller left, or the agent failed: nothing may run on.
                with contextlib.suppress(AzqemuError):
                    self._kill(pid)
                self._reap(pid)
            for t in tails:
                with contextlib.suppress(AzqemuError):
                    self.call("guest-file-close", handle=t.handle)
            if not clean and paths[0]:
                self._remove(paths)      # the wrapper unlinks them, unless it never got there

    def _open_outputs(self) -> tuple[tuple[str, str], list[_Tail]]:
        """Create the two output files (0600, a name nobody can guess) and open them for reading."""
        tag = secrets.token_hex(12)
        last: ExecError | None = None
        for d in STREAM_DIRS:
            paths = (f"{d}/{WRAPPER_NAME}.{tag}.out", f"{d}/{WRAPPER_NAME}.{tag}.err")
            tails: list[_Tail] = []
            try:
                for stream, p in zip(("stdout", "stderr"), paths):
                    handle = self._int({"handle": self.call("guest-file-open", path=p, mode="w+")},
                                       "handle", "guest-file-open")
                    tails.append(_Tail(stream, handle))
                return paths, tails
            except ExecError as exc:
                last = exc
                for t in tails:
                    with contextlib.suppress(AzqemuError):
                        self.call("guest-file-close", handle=t.handle)
                self._remove(paths)
        raise AgentError(f"cannot create the output files of a streamed exec in {self.domain_name!r}: {last}")

    def _follow(self, t: _Tail, on_output: OutputSink, total: int, what: str, *, to_end: bool) -> int:
        """Read what ``t``'s file has grown by and hand it on; returns the bytes streamed so far.
        ``to_end`` (the command has exited): until a read comes back short, else at most
        STREAM_CHUNKS_PER_ROUND chunks."""
        for _ in range(MAX_STREAM_OUTPUT_BYTES // STREAM_CHUNK_BYTES + 2 if to_end else STREAM_CHUNKS_PER_ROUND):
            data = self._read(t)
            if data:
                if total + len(data) > MAX_STREAM_OUTPUT_BYTES:
                    if total < MAX_STREAM_OUTPUT_BYTES:
                        on_output(t.stream, data[:MAX_STREAM_OUTPUT_BYTES - total])
                    raise PayloadTooLarge(f"the output of {what!r} in {self.domain_name!r}", MAX_STREAM_OUTPUT_BYTES)
                total += len(data)
                on_output(t.stream, data)
            if len(data) < STREAM_CHUNK_BYTES:
                break
        return total

    def _read(self, t: _Tail) -> bytes:
        """One guest-file-read at the handle's position. An agent that did not answer is asked
        again from the offset we reached (a seek first: the lost read may have moved it)."""
        try:
            ret = self.call("guest-file-read", handle=t.handle, count=STREAM_CHUNK_BYTES)
        except ExecError:
            raise
        except AgentError:
            self.wait_ready(AGENT_RETRY_S)
            self.call("guest-file-seek", handle=t.handle, offset=t.offset, whence="set")
            ret = self.call("guest-file-read", handle=t.handle, count=STREAM_CHUNK_BYTES)
        count = self._int(ret, "count", "guest-file-read")
        b64 = ret.get("buf-b64", "")
        if not isinstance(b64, str) or count > STREAM_CHUNK_BYTES or len(b64) > (STREAM_CHUNK_BYTES + 2) // 3 * 4:
            raise self._malformed("guest-file-read")
        try:
            data = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise self._malformed("guest-file-read") from exc
        if len(data) != count:
            raise self._malformed("guest-file-read")
        t.offset += count
        return data

    def _reap(self, pid: int) -> None:
        """Wait (briefly) for qemu-ga to see ``pid`` exit; errors are logged, not raised."""
        deadline = time.monotonic() + REAP_S
        with contextlib.suppress(AzqemuError):
            while time.monotonic() < deadline:
                st = self.call("guest-exec-status", pid=pid)
                if not isinstance(st, dict) or st.get("exited"):
                    return
                time.sleep(0.02)
            log.debug("guest pid %d in %s not reaped within %g s", pid, self.domain_name, REAP_S)

    def _remove(self, paths: Sequence[str]) -> None:
        """rm -f the output files (best effort: a guest whose agent is gone keeps them in /run)."""
        try:
            ret = self.call("guest-exec", path="/bin/rm", arg=["-f", "--", *paths])
            self._reap(self._int(ret, "pid", "guest-exec"))
        except AzqemuError as exc:
            log.warning("could not remove %s in %s: %s", " ".join(paths), self.domain_name, exc)


def _decode(data: Any, limit_bytes: int = MAX_OUTPUT_BYTES) -> bytes:
    if not data:
        return b""
    if not isinstance(data, str):
        raise AgentError("guest agent returned output that is not base64 text")
    if len(data) > limit_bytes * 4 // 3 + 4:
        raise AgentError("guest agent returned more output than azqemu accepts")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AgentError("guest agent returned output that is not base64") from exc
