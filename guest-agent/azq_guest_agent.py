#!/usr/bin/env python3
"""azqemu in-guest phase reporter: tells the host when tools run and when the sandbox idles.

It runs inside every sandbox (Debian 12 minbase, python3 stdlib only) and writes one JSON
object per line to its own virtio-serial port (org.azqemu.agent.0):

    {"v":1,"seq":7,"t":123.45,"event":"tool-start","phase":"tool","pid":812,"comm":"python3",
     "source":"guest-exec"}

Events: ``hello`` (agent started), ``tool-start`` / ``tool-end`` (a child of qemu-ga, i.e. a
command the host started with guest-exec, or a process marked with ``azq-phase run``),
``busy`` / ``idle`` (some non-kernel process is runnable or burning CPU / nothing is, and an
in-guest agent process, if configured, is blocked on its LLM connection), ``hint`` (an
explicit ``azq-phase tool|wait`` from inside the guest, forwarded) and ``state`` (the answer
to the host's ``{"cmd":"state"}``) and ``clock`` (the answer to ``{"cmd":"clock",
"realtime_ns":N}``: the host's wall clock, sent when the sandbox's vCPUs continue after a pause or
a clone, since a paused guest's clock stands still; the guest's clock is stepped to it and the
step reported as ``skew_ms``). ``t`` is the guest's CLOCK_MONOTONIC in seconds; ``seq``
counts every message the agent produced, so the host sees a gap when messages were dropped.

The guest is untrusted: the host side (azqemu/sched/agent_channel.py) validates every line
against the same schema and rate-limits it; nothing here is trusted by the host.

Cost: one scan of /proc/*/stat every POLL_BUSY_S while anything runs and every POLL_IDLE_S
once idle was reported, a few hundred microseconds for a minbase guest's ~20 processes, so
the reporter itself never keeps the guest busy (its own pid is excluded from the scan).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys
import time

PROTOCOL_VERSION = 1
AGENT_NAME = "azq-guest-agent/1"
DEFAULT_PORT = "/dev/virtio-ports/org.azqemu.agent.0"
DEFAULT_HINT_SOCKET = "/run/azq-agent.sock"

# Polling cadence. 200 ms while busy so a tool's end is reported within a fraction of a
# second; 1 s once idle has been reported, because an idle guest should cost nothing and the
# host learns of the next tool call from its own guest-exec anyway (hints wake us at once).
POLL_BUSY_S = 0.2
POLL_IDLE_S = 1.0
# After a fork while idle, scan this soon (instead of POLL_IDLE_S) to report busy quickly.
PROC_WAKE_S = 0.05
# Consecutive quiet scans before "idle" is reported: 3 x 200 ms. One scan is too noisy (a
# shell between two commands of a script sleeps for a few ms), more delays compression.
IDLE_SCANS = 3
# CPU time (user+sys, in clock ticks, summed over the considered processes and the reaped
# children of qemu-ga) per scan above which the guest counts as busy although nothing was
# caught in state R/D: 2 ticks = 20 ms in a 200 ms scan = 10% of one CPU. Daemons that wake
# now and then stay far below; a tool that computes in bursts stays above.
BUSY_TICKS_PER_SCAN = 2
# Messages kept while the host end of the port is not connected; older ones are dropped and
# counted (the host sees the count in the next message's "dropped" field and a seq gap).
MAX_QUEUED = 64
MAX_LINE_BYTES = 4096          # the host drops longer lines; we never write one
MAX_COMMAND_BYTES = 4096       # longest command line we accept from the host
# A wall clock the host may set: 2001-09-09 .. 2286-11-20 (10 digits of seconds); a value outside
# is a broken host, not a time.
CLOCK_MIN_NS, CLOCK_MAX_NS = 10**18, 10**19 - 1
MAX_SKEW_MS = 1e12             # the host's bound on a reported step (~31 years)
MAX_COMM_CHARS = 64
PF_KTHREAD = 0x00200000        # include/linux/sched.h: task flag of kernel threads
QEMU_GA_COMMS = ("qemu-ga",)   # /proc/PID/comm of /usr/bin/qemu-ga
TCP_ESTABLISHED = "01"
CLK_TCK = os.sysconf("SC_CLK_TCK")  # unit of the start time in /proc/PID/stat         # include/net/tcp_states.h, as printed in /proc/net/tcp


# ---------------------------------------------------------------------------------------
# /proc snapshot
# ---------------------------------------------------------------------------------------

class Proc:
    """What one scan learns about one process from /proc/PID/stat."""

    __slots__ = ("pid", "comm", "state", "ppid", "flags", "ticks", "child_ticks", "starttime")

    def __init__(self, pid: int, comm: str, state: str, ppid: int, flags: int, ticks: int,
                 child_ticks: int, starttime: int) -> None:
        self.pid, self.comm, self.state, self.ppid = pid, comm, state, ppid
        self.flags, self.ticks, self.child_ticks, self.starttime = flags, ticks, child_ticks, starttime

    @property
    def key(self) -> tuple[int, int]:
        # (pid, start time) names a process across pid reuse.
        return (self.pid, self.starttime)

    @property
    def is_kernel(self) -> bool:
        return bool(self.flags & PF_KTHREAD) or self.pid == 2 or self.ppid == 2


def parse_stat(text: str) -> Proc | None:
    """Parse one /proc/PID/stat line (proc(5)); the comm may hold spaces and parentheses."""
    lpar, rpar = text.find("("), text.rfind(")")
    if lpar < 0 or rpar < lpar:
        return None
    try:
        pid = int(text[:lpar])
        rest = text[rpar + 2:].split()
        # rest[0] is field 3 (state); field n is rest[n - 3].
        return Proc(pid=pid, comm=text[lpar + 1:rpar], state=rest[0], ppid=int(rest[1]),
                    flags=int(rest[6]), ticks=int(rest[11]) + int(rest[12]),
                    child_ticks=int(rest[13]) + int(rest[14]), starttime=int(rest[19]))
    except (ValueError, IndexError):
        return None


def read_stat(path: str) -> Proc | None:
    # os.open/os.read: the buffered open() adds fstat, ioctl(TCGETS) and lseek per file,
    # which under TCG is most of a scan's cost.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None   # exited between listdir and open
    try:
        data = os.read(fd, 1024)
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_stat(data.decode("utf-8", "replace"))


def _read_comm(pid: int, proc_root: str = "/proc") -> str | None:
    try:
        with open(f"{proc_root}/{pid}/comm", "rb") as f:
            return f.read(64).decode("utf-8", "replace").strip() or None
    except OSError:
        return None


class Scanner:
    """Scans /proc/*/stat, skipping pids known to be kernel threads (a minbase guest has ~45
    of them beside ~10 processes; a kernel thread never turns into a user process, and a pid
    is only reused after it wrapped around pid_max, when we would miss one scan of it)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self.kthreads: set[int] = set()

    def scan(self) -> dict[int, Proc]:
        procs: dict[int, Proc] = {}
        try:
            names = os.listdir(self.proc_root)
        except OSError:
            return procs
        pids = {int(n) for n in names if n.isdigit()}
        self.kthreads &= pids
        for pid in pids - self.kthreads:
            p = read_stat(f"{self.proc_root}/{pid}/stat")
            if p is None:
                continue
            if p.is_kernel:
                self.kthreads.add(pid)
            else:
                procs[pid] = p
        return procs


def scan_procs(proc_root: str = "/proc") -> dict[int, Proc]:
    """Every process, kernel threads included (one-off scans and tests)."""
    procs: dict[int, Proc] = {}
    try:
        names = os.listdir(proc_root)
    except OSError:
        return procs
    for name in names:
        if name.isdigit():
            p = read_stat(f"{proc_root}/{name}/stat")
            if p is not None:
                procs[p.pid] = p
    return procs


def in_subtree(procs: dict[int, Proc], pid: int, root: int) -> bool:
    seen = 0
    while pid > 1 and seen < 4096:
        if pid == root:
            return True
        p = procs.get(pid)
        if p is None:
            return False
        pid, seen = p.ppid, seen + 1
    return pid == root


def established_tcp_inodes(proc_root: str = "/proc") -> set[str]:
    inodes: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"{proc_root}/net/{name}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[3] == TCP_ESTABLISHED:
                        inodes.add(cols[9])
        except OSError:
            continue
    return inodes


def socket_inodes(pid: int, proc_root: str = "/proc") -> set[str]:
    out: set[str] = set()
    try:
        fds = os.listdir(f"{proc_root}/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"{proc_root}/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


# ---------------------------------------------------------------------------------------
# Phase detection (pure: fed with scans, returns events; unit-tested without a guest)
# ---------------------------------------------------------------------------------------

class Detector:
    """Turns successive /proc scans into tool-start/tool-end/busy/idle events.

    A tool is a child of qemu-ga (a guest-exec command) or a pid marked by a hint. The guest
    is busy when a considered process (not a kernel thread, not this agent, not qemu-ga, not
    a configured in-guest agent process) is in state R or D, or the considered processes plus
    qemu-ga's reaped children used more than BUSY_TICKS_PER_SCAN of CPU since the last scan
    (that catches short tools that started and ended between two scans, whose CPU time lands
    in qemu-ga's cutime). If in-guest agent processes are configured (by comm), the guest is
    idle only while each of them sleeps with an established TCP connection, i.e. is waiting
    for its LLM. Known blind spot: a tool that starts and ends between two scans gets no
    tool-start/tool-end pair (the host, which ran it through guest-exec, knows anyway).
    """

    def __init__(self, self_pid: int, agent_comms: tuple[str, ...] = (), scope_pid: int | None = None,
                 qemu_ga_comms: tuple[str, ...] = QEMU_GA_COMMS, idle_scans: int = IDLE_SCANS,
                 busy_ticks: int = BUSY_TICKS_PER_SCAN) -> None:
        self.self_pid = self_pid
        self.agent_comms = agent_comms
        self.scope_pid = scope_pid
        self.qemu_ga_comms = qemu_ga_comms
        self.idle_scans = idle_scans
        self.busy_ticks = busy_ticks
        self.tools: dict[tuple[int, int], tuple[str, float, str]] = {}  # key -> (comm, start t, source)
        self.marked: dict[int, float] = {}                             # pid -> hint time
        self.prev_ticks: dict[tuple[int, int], int] = {}
        self.scanned = False
        self.ga_pids: set[int] = set()
        self.forked: dict[int, float] = {}     # pid -> fork time, children of qemu-ga before exec
        self.idle = False                                               # last reported state
        self.reported = False                                           # reported anything yet
        self.quiet_scans = 0
        self.last_busy_t = time.monotonic()

    def mark(self, pid: int, t: float) -> None:
        """A hint marked pid as a tool (``azq-phase run`` execs the command in place)."""
        self.marked[pid] = t

    def agent_waiting(self, procs: dict[int, Proc], agents: list[Proc], proc_root: str) -> bool:
        if not agents:
            return True
        if any(a.state not in ("S", "I") for a in agents):
            return False
        established = established_tcp_inodes(proc_root)
        return all(socket_inodes(a.pid, proc_root) & established for a in agents)

    # -- process events (proc connector): exact tool boundaries, however short the tool --
    def on_fork(self, parent_tgid: int, child_pid: int, child_tgid: int, t: float) -> None:
        if child_pid == child_tgid and parent_tgid in self.ga_pids:
            self.forked[child_pid] = t

    def on_exec(self, pid: int, t: float, proc_root: str = "/proc") -> list[dict]:
        """A guest-exec child (or a hint-marked pid) exec'd: the tool starts, named by its
        new comm. Its start is the fork's time for guest-exec children."""
        if pid in self.forked:
            start_t, source = self.forked.pop(pid), "guest-exec"
        elif pid in self.marked:
            start_t, source = t, "hint"
        else:
            return []
        for key, (comm, start_t0, src) in list(self.tools.items()):
            if key[0] == pid:
                # Already a tool (seen by a scan before this exec): keep its start, take the
                # new program's name for its tool-end.
                new_comm = _read_comm(pid, proc_root) or comm
                self.tools[key] = (new_comm, start_t0, src)
                return []
        try:
            with open(f"{proc_root}/{pid}/stat", "rb") as f:
                p = parse_stat(f.read(1024).decode("utf-8", "replace"))
        except OSError:
            p = None   # gone already: its exit event follows and ends the tool
        key = p.key if p is not None else (pid, 0)
        comm = p.comm if p is not None else "?"
        self.tools[key] = (comm, start_t, source)
        return [{"event": "tool-start", "phase": "tool", "pid": pid, "comm": comm[:MAX_COMM_CHARS],
                 "source": source}]

    def on_exit(self, pid: int, tgid: int, t: float) -> list[dict]:
        if pid != tgid:
            return []                       # a thread, not a process
        self.forked.pop(pid, None)          # forked by qemu-ga but never exec'd
        events = []
        for key in [k for k in self.tools if k[0] == pid]:
            comm, start_t, source = self.tools.pop(key)
            self.marked.pop(pid, None)
            events.append({"event": "tool-end", "phase": "tool" if self.tools else "wait",
                           "pid": pid, "comm": comm[:MAX_COMM_CHARS], "source": source,
                           "duration_s": round(max(0.0, t - start_t), 3)})
        return events

    def step(self, procs: dict[int, Proc], t: float, proc_root: str = "/proc",
             boot_now: float | None = None) -> list[dict]:
        """Compare one scan with the previous; return the events to send (without v/seq/t)."""
        events: list[dict] = []
        ga_pids = {p.pid for p in procs.values() if p.comm in self.qemu_ga_comms}
        self.ga_pids = ga_pids

        # Tools: children of qemu-ga and hint-marked pids (whatever the scope).
        alive: dict[tuple[int, int], tuple[Proc, str]] = {}
        for p in procs.values():
            source = "guest-exec" if p.ppid in ga_pids else ("hint" if p.pid in self.marked else None)
            if source is not None and p.state not in ("Z", "X"):   # a zombie has ended
                if p.pid in self.forked and p.key not in self.tools:
                    continue    # forked, exec event not handled yet: on_exec names it
                alive[p.key] = (p, source)
        # Ends first, so a reused pid reads as tool-end then tool-start.
        for key in [k for k in self.tools if k not in alive]:
            comm, start_t, source = self.tools.pop(key)
            self.marked.pop(key[0], None)
            events.append({"event": "tool-end", "phase": "tool" if alive else "wait",
                           "pid": key[0], "comm": comm[:MAX_COMM_CHARS], "source": source,
                           "duration_s": round(max(0.0, t - start_t), 3)})
        for key, (p, source) in alive.items():
            if key not in self.tools:
                # The tool started before this scan saw it: date its start from its start
                # time (clock ticks since boot, CLOCK_BOOTTIME) when the caller knows "now" on
                # that clock, so duration_s is its real run time, not the observed one.
                start_t = t
                if boot_now is not None:
                    start_t = t - min(max(0.0, boot_now - p.starttime / CLK_TCK), POLL_IDLE_S * 2)
                self.tools[key] = (p.comm, start_t, source)
                events.append({"event": "tool-start", "phase": "tool", "pid": p.pid,
                               "comm": p.comm[:MAX_COMM_CHARS], "source": source})
        # A marked pid that never showed up (exited before the scan) is forgotten after a while.
        for pid in [pid for pid, mt in self.marked.items() if t - mt > 60 and pid not in procs]:
            del self.marked[pid]

        # Busy: runnable or CPU-burning considered processes.
        if self.scope_pid is not None:
            procs = {pid: p for pid, p in procs.items() if in_subtree(procs, pid, self.scope_pid)}
        runnable = 0
        ticks = 0
        agents: list[Proc] = []
        new_ticks: dict[tuple[int, int], int] = {}
        for p in procs.values():
            if p.is_kernel or p.pid == self.self_pid:
                continue
            if p.comm in self.agent_comms:
                agents.append(p)
                continue
            if p.pid in ga_pids:
                # qemu-ga's own CPU does not count; what its reaped children used does.
                cur = p.child_ticks
            else:
                # Own CPU plus reaped children's: a child that lived and died between two
                # scans is only visible in its parent's cutime/cstime.
                cur = p.ticks + p.child_ticks
                if p.state in ("R", "D"):
                    runnable += 1
            new_ticks[p.key] = cur
            prev = self.prev_ticks.get(p.key)
            # A process first seen now started since the last scan: all its CPU time is new.
            ticks += cur - prev if prev is not None else cur
        # A process seen last scan and gone now: its parent's cutime just grew by its total,
        # which was already counted while it lived; take back what we counted.
        for key, prev in self.prev_ticks.items():
            if key not in new_ticks and key[0] not in procs:
                ticks -= prev
        ticks = max(0, ticks)
        first_scan, self.scanned = not self.scanned, True
        self.prev_ticks = new_ticks
        busy = runnable > 0 or (not first_scan and ticks >= self.busy_ticks)
        if not busy and not self.agent_waiting(procs, agents, proc_root):
            busy = True

        if busy:
            self.quiet_scans = 0
            self.last_busy_t = t
            if self.idle or not self.reported:
                self.idle, self.reported = False, True
                events.append({"event": "busy", "phase": "tool", "tools": len(self.tools),
                               "runnable": runnable})
        else:
            self.quiet_scans += 1
            if (not self.idle or not self.reported) and self.quiet_scans >= self.idle_scans:
                self.idle, self.reported = True, True
                events.append({"event": "idle", "phase": "wait", "tools": len(self.tools),
                               "idle_s": round(max(0.0, t - self.last_busy_t), 3)})
        return events

    def state(self) -> dict:
        return {"event": "state", "phase": "wait" if self.idle else "tool",
                "tools": len(self.tools), "idle": self.idle}


# ---------------------------------------------------------------------------------------
# The port (virtio-serial char device) and the hint socket
# ---------------------------------------------------------------------------------------

class Port:
    """Newline-delimited JSON over the virtio-serial port, non-blocking.

    virtio_console semantics (drivers/char/virtio_console.c): while no host process holds
    the chardev's other end, poll() reports POLLHUP, read() returns 0 and a non-blocking
    write() returns EAGAIN. So the port is polled for input only while the host is
    connected, and messages are queued (bounded) until a write goes through again.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        self.queue: list[bytes] = []
        self.dropped = 0
        self.connected = True
        self.inbuf = b""
        self.pending = b""   # the unwritten rest of a partly written line
        self.wake_fd: int | None = None

    def wake_on_host(self) -> int | None:
        """Ask the kernel for SIGIO when the host connects or disconnects, or sends data
        (virtio_console sends it on VIRTIO_CONSOLE_PORT_OPEN and on input), delivered as a
        byte on the returned fd (signal.set_wakeup_fd), which the main loop polls. Without it
        a port found disconnected (POLLHUP: a clone's host end is not connected yet) would be
        polled again only after a write of ours went through, and a host command sent meanwhile
        (the clock after a clone) would wait for our next event. None: not available here."""
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            signal.signal(signal.SIGIO, lambda _signum, _frame: None)  # before O_ASYNC: SIGIO kills
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            fcntl.fcntl(self.fd, fcntl.F_SETOWN, os.getpid())
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) | os.O_ASYNC)
        except (OSError, ValueError):
            os.close(r)
            os.close(w)
            return None
        self.wake_fd = r
        return r

    def drain_wake(self) -> None:
        assert self.wake_fd is not None
        with contextlib.suppress(BlockingIOError):
            while os.read(self.wake_fd, 256):
                pass

    def send(self, line: bytes) -> None:
        if len(self.queue) >= MAX_QUEUED:
            self.queue.pop(0)
            self.dropped += 1
        self.queue.append(line)
        self.flush()

    def flush(self) -> None:
        while self.pending or self.queue:
            if not self.pending:
                self.pending = self.queue.pop(0)
            try:
                n = os.write(self.fd, self.pending)
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EPIPE, errno.EIO, errno.ENODEV):
                    self.connected = False
                    return
                raise
            self.connected = True
            self.pending = self.pending[n:]

    def read_commands(self) -> list[bytes]:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return []
        except OSError:
            self.connected = False
            return []
        if not data:
            self.connected = False  # host end not connected: stop polling until a write works
            return []
        self.connected = True
        self.inbuf += data
        lines = []
        while b"\n" in self.inbuf:
            line, self.inbuf = self.inbuf.split(b"\n", 1)
            if len(line) <= MAX_COMMAND_BYTES:
                lines.append(line)
        if len(self.inbuf) > MAX_COMMAND_BYTES:
            self.inbuf = b""
        return lines


SO_PASSCRED = getattr(socket, "SO_PASSCRED", 16)
SCM_CREDENTIALS = getattr(socket, "SCM_CREDENTIALS", 2)
UCRED = struct.Struct("iII")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;} (Linux ABI)


class HintSocket:
    """Datagram unix socket where ``azq-phase`` drops hints; the sender's pid comes from the
    kernel (SCM_CREDENTIALS), never from the datagram."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                  | socket.SOCK_CLOEXEC)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_PASSCRED, 1)
        self.sock.bind(path)
        os.chmod(path, 0o666)  # any process in the sandbox may hint, whatever its user

    def receive(self) -> list[tuple[str, bool, int | None]]:
        """Return (phase, run, sender pid) for each valid datagram waiting."""
        hints = []
        for _ in range(64):  # bounded per wake-up: a flood cannot starve the scan
            try:
                data, ancdata, _flags, _addr = self.sock.recvmsg(512, socket.CMSG_SPACE(UCRED.size))
            except (BlockingIOError, InterruptedError):
                break
            pid = None
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == SCM_CREDENTIALS and len(cdata) >= UCRED.size:
                    pid = UCRED.unpack_from(cdata)[0]
            try:
                msg = json.loads(data.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                continue
            if not isinstance(msg, dict) or msg.get("phase") not in ("tool", "wait"):
                continue
            hints.append((msg["phase"], msg.get("run") is True, pid))
        return hints

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class ProcEvents:
    """Fork/exec/exit notifications from the kernel's process events connector.

    ABI: include/uapi/linux/connector.h and cn_proc.h. A NETLINK_CONNECTOR socket bound to
    the CN_IDX_PROC group receives, after a PROC_CN_MCAST_LISTEN request, one message per
    event: struct nlmsghdr (16 bytes), struct cn_msg (20 bytes), then struct proc_event
    {u32 what; u32 cpu; u64 timestamp_ns (CLOCK_MONOTONIC); union event_data}. Needs
    CAP_NET_ADMIN (the reporter runs as root) and CONFIG_PROC_EVENTS (Debian's kernels have
    it); without them the reporter falls back to scanning alone.
    """

    NETLINK_CONNECTOR = 11
    CN_IDX_PROC = CN_VAL_PROC = 1
    PROC_CN_MCAST_LISTEN = 1
    NLMSG_DONE = 3
    FORK, EXEC, EXIT = 0x00000001, 0x00000002, 0x80000000
    NLMSGHDR = struct.Struct("=IHHII")
    CN_MSG = struct.Struct("=IIIIHH")
    EVENT_HEAD = struct.Struct("=IIQ")        # what, cpu, timestamp_ns
    PAYLOAD_AT = NLMSGHDR.size + CN_MSG.size  # 36
    MAX_PER_WAKEUP = 512                      # bounded work per wake-up; the scan catches up

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK
                                  | socket.SOCK_CLOEXEC, self.NETLINK_CONNECTOR)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            self.sock.bind((0, self.CN_IDX_PROC))
            op = struct.pack("=I", self.PROC_CN_MCAST_LISTEN)
            cn = self.CN_MSG.pack(self.CN_IDX_PROC, self.CN_VAL_PROC, 0, 0, len(op), 0)
            hdr = self.NLMSGHDR.pack(self.NLMSGHDR.size + len(cn) + len(op), self.NLMSG_DONE, 0, 0,
                                     self.sock.getsockname()[0])
            self.sock.sendto(hdr + cn + op, (0, 0))
        except OSError:
            self.sock.close()
            raise
        self.overrun = False

    def read(self) -> list[tuple[int, float, tuple[int, ...]]]:
        """(what, monotonic seconds, event fields) for each waiting event."""
        out = []
        for _ in range(self.MAX_PER_WAKEUP):
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as err:
                if err.errno == errno.ENOBUFS:     # the kernel dropped events: rescan
                    self.overrun = True
                    continue
                raise
            if len(data) < self.PAYLOAD_AT + self.EVENT_HEAD.size:
                continue
            what, _cpu, ts_ns = self.EVENT_HEAD.unpack_from(data, self.PAYLOAD_AT)
            body = data[self.PAYLOAD_AT + self.EVENT_HEAD.size:]
            n = {self.FORK: 4, self.EXEC: 2, self.EXIT: 6}.get(what)
            if n is None or len(body) < 4 * n:
                continue
            out.append((what, ts_ns / 1e9, struct.unpack_from(f"={n}i", body)))
        return out

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------
# Main loop
# ---------------------------------------------------------------------------------------

class Agent:
    def __init__(self, port: Port, hints: HintSocket | None, detector: Detector,
                 proc_root: str = "/proc", proc_events: ProcEvents | None = None,
                 set_clock: bool = True) -> None:
        self.port, self.hints, self.detector, self.proc_root = port, hints, detector, proc_root
        self.proc_events = proc_events
        self.set_clock = set_clock
        self.scanner = Scanner(proc_root)
        self.seq = 0
        self.stop = False

    def emit(self, msg: dict) -> None:
        full = {"v": PROTOCOL_VERSION, "seq": self.seq, "t": round(time.monotonic(), 3)}
        full.update(msg)
        if self.port.dropped:
            full["dropped"] = self.port.dropped
            self.port.dropped = 0
        self.seq += 1
        line = json.dumps(full, separators=(",", ":"), ensure_ascii=True).encode() + b"\n"
        if len(line) <= MAX_LINE_BYTES:
            self.port.send(line)

    def handle_command(self, line: bytes) -> None:
        try:
            cmd = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            return
        if isinstance(cmd, dict) and cmd.get("cmd") == "state":
            self.emit(self.detector.state())
        elif isinstance(cmd, dict) and cmd.get("cmd") == "clock":
            self.clock(cmd.get("realtime_ns"))

    def clock(self, realtime_ns: object) -> None:
        """Step the wall clock to the host's: a paused guest's clock stands still (QEMU stops
        its virtual clock with the vCPUs), so after a compressed wait, or a clone of a template
        saved hours ago, it is behind by as long. CLOCK_MONOTONIC is left alone."""
        if type(realtime_ns) is not int or not CLOCK_MIN_NS <= realtime_ns <= CLOCK_MAX_NS:
            return
        skew_ms = (realtime_ns - time.clock_gettime_ns(time.CLOCK_REALTIME)) / 1e6
        done = False
        if self.set_clock:
            try:
                time.clock_settime_ns(time.CLOCK_REALTIME, realtime_ns)
                done = True
            except OSError:
                pass
        self.emit({"event": "clock", "phase": "wait" if self.detector.idle else "tool", "set": done,
                   "skew_ms": round(max(-MAX_SKEW_MS, min(MAX_SKEW_MS, skew_ms)), 3)})

    def handle_proc_events(self, next_scan: float) -> float:
        assert self.proc_events is not None
        d = self.detector
        activity = False
        for what, t, f in self.proc_events.read():
            if what == ProcEvents.FORK:
                d.on_fork(parent_tgid=f[1], child_pid=f[2], child_tgid=f[3], t=t)
                activity = activity or f[1] != os.getpid()
            elif what == ProcEvents.EXEC:
                for msg in d.on_exec(f[0], t, self.proc_root):
                    self.emit(msg)
            elif what == ProcEvents.EXIT:
                for msg in d.on_exit(f[0], f[1], t):
                    self.emit(msg)
        if self.proc_events.overrun:
            self.proc_events.overrun = False
            return time.monotonic()
        if activity and d.idle:
            # Something forked while we report idle: look within PROC_WAKE_S, not POLL_IDLE_S.
            return min(next_scan, time.monotonic() + PROC_WAKE_S)
        return next_scan

    def run(self) -> None:
        self.emit({"event": "hello", "phase": "tool", "agent": AGENT_NAME, "pid": os.getpid()})
        poller = select.poll()
        if self.hints is not None:
            poller.register(self.hints.sock.fileno(), select.POLLIN)
        if self.proc_events is not None:
            poller.register(self.proc_events.sock.fileno(), select.POLLIN)
        wake_fd = self.port.wake_on_host()
        if wake_fd is not None:
            poller.register(wake_fd, select.POLLIN)
        port_polled = False
        next_scan = time.monotonic()
        while not self.stop:
            # Poll the port for host commands only while the host is connected (POLLHUP
            # otherwise fires at once and forever); retry queued writes at every wake-up.
            want_port = self.port.connected
            if want_port != port_polled:
                if want_port:
                    poller.register(self.port.fd, select.POLLIN)
                else:
                    poller.unregister(self.port.fd)
                port_polled = want_port
            timeout_s = max(0.0, next_scan - time.monotonic())
            try:
                ready = poller.poll(timeout_s * 1000)
            except InterruptedError:
                continue
            for fd, ev in ready:
                if self.hints is not None and fd == self.hints.sock.fileno():
                    for phase, run, pid in self.hints.receive():
                        msg: dict[str, object] = {"event": "hint", "phase": phase, "source": "azq-phase"}
                        if pid is not None:
                            msg["pid"] = pid
                        self.emit(msg)
                        if run and pid is not None:
                            self.detector.mark(pid, time.monotonic())
                            next_scan = time.monotonic()   # report the tool-start now
                elif self.proc_events is not None and fd == self.proc_events.sock.fileno():
                    next_scan = self.handle_proc_events(next_scan)
                elif fd == wake_fd:
                    # The host end changed or sent something: poll the port again (a POLLHUP
                    # without input turns it off again if the host is still away).
                    self.port.drain_wake()
                    self.port.connected = True
                elif fd == self.port.fd:
                    if ev & select.POLLIN:
                        for line in self.port.read_commands():
                            self.handle_command(line)
                    if ev & (select.POLLHUP | select.POLLERR) and not ev & select.POLLIN:
                        self.port.connected = False
            self.port.flush()
            now = time.monotonic()
            if now >= next_scan:
                boot_now = time.clock_gettime(time.CLOCK_BOOTTIME)
                for msg in self.detector.step(self.scanner.scan(), now, self.proc_root, boot_now):
                    self.emit(msg)
                # Idle: scan slowly. Without process events a live tool keeps the fast cadence
                # so that its end is seen within a scan; with them its exit is an event.
                slow = self.detector.idle and (self.proc_events is not None or not self.detector.tools)
                next_scan = now + (POLL_IDLE_S if slow else POLL_BUSY_S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="azqemu in-guest phase reporter")
    ap.add_argument("--port", default=DEFAULT_PORT, help="virtio-serial port (char device)")
    ap.add_argument("--hint-socket", default=DEFAULT_HINT_SOCKET,
                    help="unix datagram socket for azq-phase hints ('' to disable)")
    ap.add_argument("--agent-comm", action="append", default=[],
                    help="comm of an in-guest agent process that must be waiting on its LLM "
                         "connection for the sandbox to count as idle (repeatable)")
    ap.add_argument("--proc", default="/proc", help=argparse.SUPPRESS)
    ap.add_argument("--scope-pid", type=int, default=None,
                    help="consider only this process and its descendants (tests, containers)")
    ap.add_argument("--qemu-ga-comm", action="append", default=[], help=argparse.SUPPRESS)
    ap.add_argument("--no-proc-events", action="store_true",
                    help="do not use the kernel's process events connector (scan /proc only)")
    ap.add_argument("--no-set-clock", action="store_true",
                    help="answer the host's clock command without setting the clock (tests)")
    args = ap.parse_args(argv)

    try:
        port = Port(args.port)
    except OSError as err:
        print(f"azq-guest-agent: cannot open {args.port}: {err.strerror}", file=sys.stderr)
        return 1
    hints = None
    if args.hint_socket:
        try:
            hints = HintSocket(args.hint_socket)
        except OSError as err:
            print(f"azq-guest-agent: no hint socket at {args.hint_socket}: {err.strerror}",
                  file=sys.stderr)
    detector = Detector(os.getpid(), tuple(args.agent_comm), args.scope_pid,
                        tuple(args.qemu_ga_comm) or QEMU_GA_COMMS)
    proc_events = None
    if not args.no_proc_events:
        try:
            proc_events = ProcEvents()
        except OSError as err:
            print(f"azq-guest-agent: no process events ({err.strerror or err}); scanning only",
                  file=sys.stderr)
    agent = Agent(port, hints, detector, args.proc, proc_events, set_clock=not args.no_set_clock)

    def on_signal(_signum: int, _frame: object) -> None:
        agent.stop = True
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.run()
    finally:
        if hints is not None:
            hints.close()
        if proc_events is not None:
            proc_events.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
