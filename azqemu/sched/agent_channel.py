"""Host side of the in-guest phase reporter's channel: framing, rate limit and strict schema.

Every sandbox has its own virtio-serial port (org.azqemu.agent.0) on which the in-guest
reporter (guest-agent/azq_guest_agent.py) writes newline-delimited JSON. The guest is
untrusted, so this reader assumes every byte is hostile:

- framing is bounded: a line longer than ``max_line_bytes`` is dropped (and the rest of it up
  to the next newline), so the buffer never grows past that bound whatever the guest writes;
- each line costs a token from a per-channel token bucket before it is parsed at all, and
  every byte costs one from a byte budget that the reader checks before it reads (over it,
  the reader stops reading the channel until the budget refills: the guest's port fills and
  its writer blocks), so a flooding guest, even one streaming bare newlines, costs the host a
  bounded amount of work per second;
- the schema is strict: a known event, exactly its fields, the right types and bounds, no
  NaN, no duplicate keys, no control characters; anything else is rejected and counted;
- an accepted message names its sandbox from the channel it arrived on, never from its
  content (a message that carries a sandbox/domain field is rejected as an unknown field), so
  what one guest says can only ever make azqemu compress or resume that guest.

Nothing here raises on bad input: rejects are counted in ``ChannelStats`` (exposed for
logs and metrics) and the last reason is kept for debugging.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
# A legitimate message is ~150 bytes; 4 KiB leaves room for growth and bounds the parser.
MAX_LINE_BYTES = 4096
# The reporter sends a few messages per tool call and at most ~5 state changes a second
# (200 ms scans). 20/s sustained with a burst of 40 covers a burst of short tool calls; a
# guest above that is broken or hostile and loses the excess.
RATE_PER_S = 20.0
BURST = 40
# Bytes: 20 lines/s of ~150 bytes is 3 KB/s; 16 KiB/s sustained and a 64 KiB burst leave
# five times that, and bound what one guest makes the shared reader thread parse.
RATE_BYTES_PER_S = 16384.0
BURST_BYTES = 65536
MAX_STR_CHARS = 64
MAX_SEQ = 2**53            # JSON-safe integer bound
MAX_PID = 4194304          # PID_MAX_LIMIT on 64-bit Linux
MAX_T_S = 1e10             # ~300 years of guest monotonic time
MAX_COUNT = 1_000_000
MAX_SKEW_MS = 1e12         # a clock step the guest reports (~31 years either way)

EVENTS = ("hello", "tool-start", "tool-end", "idle", "busy", "hint", "state", "clock")
PHASES = ("tool", "wait")
COMMON_FIELDS = {"v", "seq", "t", "event", "phase"}
OPTIONAL_COMMON = {"dropped"}
# event -> (required fields beyond the common ones, optional fields, allowed phases)
SCHEMA: dict[str, tuple[frozenset[str], frozenset[str], tuple[str, ...]]] = {
    "hello": (frozenset({"agent"}), frozenset({"pid"}), PHASES),
    "tool-start": (frozenset({"pid", "comm", "source"}), frozenset(), ("tool",)),
    "tool-end": (frozenset({"pid", "comm", "source", "duration_s"}), frozenset(), PHASES),
    "idle": (frozenset({"tools"}), frozenset({"idle_s"}), ("wait",)),
    "busy": (frozenset({"tools"}), frozenset({"runnable"}), ("tool",)),
    "hint": (frozenset({"source"}), frozenset({"pid"}), PHASES),
    "state": (frozenset({"tools", "idle"}), frozenset(), PHASES),
    "clock": (frozenset({"set", "skew_ms"}), frozenset(), PHASES),
}
SOURCES = {"tool-start": ("guest-exec", "hint"), "tool-end": ("guest-exec", "hint"),
           "hint": ("azq-phase",)}


@dataclass(frozen=True)
class AgentMessage:
    """One validated message. ``sandbox`` is the channel's, never the guest's word."""

    sandbox: str
    event: str
    phase: str
    seq: int
    guest_t_s: float
    received_s: float
    pid: int | None = None
    comm: str | None = None
    source: str | None = None
    duration_s: float | None = None
    tools: int | None = None
    idle: bool | None = None
    idle_s: float | None = None
    runnable: int | None = None
    agent: str | None = None
    set: bool | None = None          # clock: the guest stepped its clock to the host's
    skew_ms: float | None = None     # clock: by how much (host minus guest, before the step)
    dropped: int = 0


@dataclass
class ChannelStats:
    lines: int = 0
    accepted: int = 0
    dropped_long: int = 0        # lines over max_line_bytes
    dropped_rate: int = 0        # lines over the token bucket
    throttled: int = 0           # times the reader stopped reading: byte budget spent
    rejected_json: int = 0       # not UTF-8, not JSON, NUL bytes, nesting
    rejected_schema: int = 0     # JSON but not a valid message
    seq_gaps: int = 0            # messages the guest says it sent that never arrived
    seq_resets: int = 0          # seq went backwards (reporter restarted)
    guest_dropped: int = 0       # messages the reporter itself dropped (host not connected)
    clock_steps: int = 0         # clock commands the guest answered having set its clock
    clock_skew_ms_last: float = 0.0   # the step of the last of them (host minus guest)
    last_reject: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Reject(Exception):
    """A line that is not a valid message (internal: counted, never raised to callers)."""


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate_per_s, self.burst, self.clock = rate_per_s, float(burst), clock
        self.tokens = float(burst)
        self.last = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + max(0.0, now - self.last) * self.rate_per_s)
        self.last = now

    def take(self, n: float = 1.0) -> bool:
        self._refill()
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def available(self) -> int:
        """Whole tokens available now."""
        self._refill()
        return int(self.tokens)

    def charge(self, n: float) -> None:
        """Spend ``n`` tokens that were checked with available()."""
        self._refill()
        self.tokens -= n

    def seconds_until(self, n: float) -> float:
        """How long until ``n`` tokens are available."""
        self._refill()
        return max(0.0, (n - self.tokens) / self.rate_per_s)


def _reject_constant(name: str) -> Any:
    raise Reject(f"non-finite number {name}")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise Reject(f"duplicate key {k!r}")
        out[k] = v
    return out


def _int(msg: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = msg[key]
    if type(v) is not int or not lo <= v <= hi:   # bool is an int subclass: excluded
        raise Reject(f"{key} must be an integer in [{lo}, {hi}]")
    return v


def _num(msg: dict[str, Any], key: str, hi: float, lo: float = 0.0) -> float:
    v = msg[key]
    if type(v) not in (int, float) or not math.isfinite(v) or not lo <= v <= hi:
        raise Reject(f"{key} must be a number in [{lo:g}, {hi:g}]")
    return float(v)


def _str(msg: dict[str, Any], key: str, allowed: tuple[str, ...] | None = None) -> str:
    v = msg[key]
    if type(v) is not str or not 0 < len(v) <= MAX_STR_CHARS:
        raise Reject(f"{key} must be a string of 1-{MAX_STR_CHARS} characters")
    if not v.isprintable():
        raise Reject(f"{key} holds control characters")
    if allowed is not None and v not in allowed:
        raise Reject(f"{key} must be one of {', '.join(allowed)}")
    return v


def validate(obj: Any, sandbox: str, received_s: float) -> AgentMessage:
    """Check one decoded JSON value against the schema; raise Reject with the reason."""
    if type(obj) is not dict:
        raise Reject("not a JSON object")
    event = obj.get("event")
    if type(event) is not str or event not in SCHEMA:
        raise Reject("unknown event")
    required, optional, phases = SCHEMA[event]
    keys = set(obj)
    missing = (COMMON_FIELDS | required) - keys
    if missing:
        raise Reject(f"missing field(s) {', '.join(sorted(missing))}")
    unknown = keys - COMMON_FIELDS - OPTIONAL_COMMON - required - optional
    if unknown:
        raise Reject(f"unknown field(s) {', '.join(sorted(unknown))}")
    if _int(obj, "v", 0, 1 << 16) != PROTOCOL_VERSION:
        raise Reject("unsupported protocol version")
    phase = _str(obj, "phase", phases)
    fields: dict[str, Any] = {}
    if "pid" in obj:
        fields["pid"] = _int(obj, "pid", 1, MAX_PID)
    if "comm" in obj:
        fields["comm"] = _str(obj, "comm")
    if "source" in obj:
        fields["source"] = _str(obj, "source", SOURCES[event])
    if "duration_s" in obj:
        fields["duration_s"] = _num(obj, "duration_s", MAX_T_S)
    if "tools" in obj:
        fields["tools"] = _int(obj, "tools", 0, MAX_COUNT)
    if "runnable" in obj:
        fields["runnable"] = _int(obj, "runnable", 0, MAX_COUNT)
    if "idle_s" in obj:
        fields["idle_s"] = _num(obj, "idle_s", MAX_T_S)
    for flag in ("idle", "set"):
        if flag in obj:
            if type(obj[flag]) is not bool:
                raise Reject(f"{flag} must be a boolean")
            fields[flag] = obj[flag]
    if "skew_ms" in obj:
        fields["skew_ms"] = _num(obj, "skew_ms", MAX_SKEW_MS, lo=-MAX_SKEW_MS)
    if "agent" in obj:
        fields["agent"] = _str(obj, "agent")
    if "dropped" in obj:
        fields["dropped"] = _int(obj, "dropped", 0, MAX_SEQ)
    if event == "state" and fields["idle"] != (phase == "wait"):
        raise Reject("state: idle contradicts phase")
    return AgentMessage(sandbox=sandbox, event=event, phase=phase,
                        seq=_int(obj, "seq", 0, MAX_SEQ), guest_t_s=_num(obj, "t", MAX_T_S),
                        received_s=received_s, **fields)


@dataclass
class AgentChannel:
    """The reader of one sandbox's channel: feed it bytes, get validated messages.

    >>> ch = AgentChannel("sb-1")
    >>> [m.event for m in ch.feed(b'{"v":1,"seq":0,"t":1.0,"event":"idle","phase":"wait","tools":0}\\n')]
    ['idle']
    """

    sandbox: str
    rate_per_s: float = RATE_PER_S
    burst: int = BURST
    rate_bytes_per_s: float = RATE_BYTES_PER_S
    burst_bytes: int = BURST_BYTES
    max_line_bytes: int = MAX_LINE_BYTES
    clock: Callable[[], float] = time.monotonic
    stats: ChannelStats = field(default_factory=ChannelStats)

    def __post_init__(self) -> None:
        self._buf = bytearray()
        self._discarding = False   # inside an over-long line: drop up to the next newline
        self._bucket = TokenBucket(self.rate_per_s, self.burst, self.clock)
        self._bytes = TokenBucket(self.rate_bytes_per_s, self.burst_bytes, self.clock)
        self._last_seq: int | None = None

    def read_allowance(self) -> int:
        """Bytes the reader may read now (0: stop reading until ``resume_in_s()``)."""
        n = self._bytes.available()
        if n < 1:
            self.stats.throttled += 1
        return n

    def resume_in_s(self, want_bytes: int = 4096) -> float:
        """Seconds until ``want_bytes`` of budget are back."""
        return self._bytes.seconds_until(min(want_bytes, self.burst_bytes))

    def feed(self, data: bytes) -> list[AgentMessage]:
        """Take the next bytes read from the channel; return the messages they complete.
        The bytes are charged to the byte budget (the reader asked ``read_allowance`` first)."""
        self._bytes.charge(len(data))
        out: list[AgentMessage] = []
        start = 0
        while start < len(data):
            nl = data.find(b"\n", start)
            end = len(data) if nl < 0 else nl
            chunk = data[start:end]
            if self._discarding:
                pass
            elif len(self._buf) + len(chunk) > self.max_line_bytes:
                self._buf.clear()
                self._discarding = True
                self.stats.lines += 1
                self.stats.dropped_long += 1
                self.stats.last_reject = "line too long"
            else:
                self._buf += chunk
            if nl < 0:
                break
            if self._discarding:
                self._discarding = False
            else:
                msg = self._line(bytes(self._buf))
                self._buf.clear()
                if msg is not None:
                    out.append(msg)
            start = nl + 1
        return out

    def _line(self, line: bytes) -> AgentMessage | None:
        self.stats.lines += 1
        if not self._bucket.take():
            self.stats.dropped_rate += 1
            self.stats.last_reject = "rate limit"
            return None
        line = line.rstrip(b"\r")
        if not line.strip():
            return None                       # blank lines are harmless keep-alives
        try:
            if b"\x00" in line:
                raise Reject("NUL byte")
            obj = json.loads(line.decode("utf-8"), object_pairs_hook=_no_duplicates,
                             parse_constant=_reject_constant)
        except Reject as err:
            self.stats.rejected_json += 1
            self.stats.last_reject = str(err)
            return None
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            self.stats.rejected_json += 1
            self.stats.last_reject = f"bad JSON: {type(err).__name__}"
            return None
        try:
            msg = validate(obj, self.sandbox, self.clock())
        except Reject as err:
            self.stats.rejected_schema += 1
            self.stats.last_reject = str(err)
            return None
        self._track_seq(msg)
        self.stats.accepted += 1
        self.stats.guest_dropped += msg.dropped
        if msg.event == "clock" and msg.set:
            self.stats.clock_steps += 1
            self.stats.clock_skew_ms_last = msg.skew_ms or 0.0
        return msg

    def _track_seq(self, msg: AgentMessage) -> None:
        # Gaps and resets are counted, not rejected: a replayed or reordered message can at
        # worst flip this one sandbox's phase, which its guest could do anyway.
        if self._last_seq is not None:
            if msg.seq <= self._last_seq:
                self.stats.seq_resets += 1
            elif msg.seq > self._last_seq + 1:
                self.stats.seq_gaps += msg.seq - self._last_seq - 1
        self._last_seq = msg.seq


def encode_command(cmd: str, **fields: int) -> bytes:
    """A host -> guest command line: ``state``, or ``clock`` with ``realtime_ns`` (the host's
    wall clock, to which the guest steps its own)."""
    allowed = {"state": set(), "clock": {"realtime_ns"}}
    if cmd not in allowed or set(fields) != allowed[cmd]:
        raise ValueError(f"unknown agent command {cmd!r} with {sorted(fields)}")
    return json.dumps({"cmd": cmd, **fields}, separators=(",", ":")).encode() + b"\n"
