"""A client of the QEMU guest agent (qemu-ga): explicit methods, no attribute magic.

It talks through a transport, a callable ``send(command_json, timeout_s) -> reply_json``; the
virt layer provides one over libvirt's agent channel (``Domain.agent_command``), which
serialises access and knows whether the agent's port is open. The agent may not be up yet
(a guest still booting, a clone just resumed): ``wait_ready`` retries ``guest-ping`` until a
deadline.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from azqemu.errors import AgentError, AgentTimeout, DomainNotFound, DomainStateError, ExecError, VirtError

log = logging.getLogger(__name__)

Transport = Callable[[str, int], str]

# guest-exec-status is polled; start fast (short tool calls finish in milliseconds) and back
# off so that a long command does not keep the agent, and the vCPU, busy.
POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05
# libvirt's agent calls take whole seconds as their timeout.
CALL_TIMEOUT_S = 10
# How long exec waits for an agent that libvirt reported unresponsive before giving up.
AGENT_RETRY_S = 15.0
# Output is captured by qemu-ga in guest memory; bound what we accept from an untrusted guest.
MAX_OUTPUT_BYTES = 16 << 20


@dataclass(frozen=True)
class ExecResult:
    exit_code: int
    stdout: bytes
    stderr: bytes
    duration_s: float
    signal: int | None = None


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
        except ValueError as exc:
            raise AgentError(f"guest agent of {self.domain_name!r} sent invalid JSON") from exc
        if not isinstance(data, dict):
            raise AgentError(f"guest agent of {self.domain_name!r} sent a malformed reply")
        if "error" in data:
            err = data["error"] if isinstance(data["error"], dict) else {}
            raise ExecError(str(err.get("desc", "unknown agent error"))[:500], str(err.get("class", "")))
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
             env: Sequence[str] | None = None) -> ExecResult:
        """Run ``argv`` in the guest and wait for it; its exit code is returned, not raised.

        A command that cannot be started (not found, not executable) raises ExecError. On
        timeout the guest process is killed and AgentTimeout is raised.
        """
        if not argv:
            raise ExecError("empty command")
        args: dict[str, Any] = {"path": argv[0], "arg": list(argv[1:]), "capture-output": True}
        if stdin is not None:
            args["input-data"] = base64.b64encode(stdin).decode()
        if env is not None:
            args["env"] = list(env)
        start = time.monotonic()
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
        pid = int(ret["pid"])
        poll = POLL_FIRST_S
        while True:
            try:
                st = self.call("guest-exec-status", pid=pid)
            except ExecError:
                raise
            except AgentError:
                self.wait_ready(AGENT_RETRY_S)  # the status query is idempotent: ask again
                continue
            if st.get("exited"):
                break
            if time.monotonic() - start > timeout_s:
                self._kill(pid)
                raise AgentTimeout(self.domain_name, timeout_s, f"finish {argv[0]!r}")
            time.sleep(poll)
            poll = min(poll * 2, POLL_MAX_S)
        out = _decode(st.get("out-data"))
        err = _decode(st.get("err-data"))
        code = st.get("exitcode")
        sig = st.get("signal")
        if code is None:
            code = 128 + int(sig or 0)
        return ExecResult(int(code), out, err, time.monotonic() - start, sig)

    def _kill(self, pid: int) -> None:
        try:
            self.call("guest-exec", path="/bin/kill", arg=["-9", str(pid)])
        except AgentError:
            log.warning("could not kill guest pid %d in %s", pid, self.domain_name)


def _decode(data: str | None) -> bytes:
    if not data:
        return b""
    if len(data) > MAX_OUTPUT_BYTES * 4 // 3 + 4:
        raise AgentError("guest agent returned more output than azqemu accepts")
    return base64.b64decode(data)
