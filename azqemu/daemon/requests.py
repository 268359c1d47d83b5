"""Requests checked at the door: every argument of every operation, before any service runs.

The daemon's API (``azqemu.api.app``) calls ``check_args`` for every route, after the request
model has checked the JSON types. Its unix socket is root-only, but what arrives on it comes
from scripts, orchestrators and benchmarks, and names become libvirt domain names, directories under the state and run
directories, and parts of unix socket paths. So each argument is checked here, once, by its
name (the operations name their arguments consistently): names against ``azqemu.names``
(no ``/``, no ``..``, ASCII, 1-64 characters), counts and sizes as integers in range, times as
finite numbers in range (no NaN or infinity), flags as booleans, lists as lists of strings.
A bad request gets one ``ConfigError`` (HTTP 400) and nothing is touched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from azqemu.errors import ConfigError
from azqemu.names import validate_name

MAX_CLONES_PER_REQUEST = 256
MAX_ARGV_BYTES = 1 << 20          # one command line; the guest's own ARG_MAX is 2 MiB
MAX_STDIN_B64_BYTES = 64 << 20    # the API's exec body limit (azqemu.api.guard)
MAX_TIMEOUT_S = 7 * 86400.0


def _name(what: str) -> Callable[[str, Any], None]:
    def check(_arg: str, v: Any) -> None:
        validate_name(v, what)
    return check


def _names(arg: str, v: Any) -> None:
    if not isinstance(v, list) or len(v) > MAX_CLONES_PER_REQUEST:
        raise ConfigError(f"{arg}: expected a list of at most {MAX_CLONES_PER_REQUEST} names")
    for n in v:
        validate_name(n, "sandbox name")


def _prefix(arg: str, v: Any) -> None:
    # A prefix becomes a name with a number after it: it must make valid names.
    if not isinstance(v, str):
        raise ConfigError(f"{arg}: expected a string")
    validate_name(v + "0", "name prefix")
    validate_name(v + str(10 ** 4), "name prefix")


def _int(lo: int, hi: int) -> Callable[[str, Any], None]:
    def check(arg: str, v: Any) -> None:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"{arg}: expected an integer from {lo} to {hi}, got {_shown(v)}")
    return check


def _seconds(lo: float, hi: float, *, open_lo: bool = False) -> Callable[[str, Any], None]:
    def check(arg: str, v: Any) -> None:
        ok = (not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
              and (v > lo if open_lo else v >= lo) and v <= hi)
        if not ok:
            bound = f"above {lo:g}" if open_lo else f"from {lo:g}"
            raise ConfigError(f"{arg}: expected a finite number of seconds {bound} to {hi:g}, got {_shown(v)}")
    return check


def _bool(arg: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise ConfigError(f"{arg}: expected true or false, got {_shown(v)}")


def _str(arg: str, v: Any) -> None:
    if not isinstance(v, str) or len(v) > 256:
        raise ConfigError(f"{arg}: expected a short string, got {_shown(v)}")


def _argv(arg: str, v: Any) -> None:
    if (not isinstance(v, list) or not v or not all(isinstance(a, str) for a in v)
            or sum(len(a.encode(errors="surrogatepass")) + 1 for a in v) > MAX_ARGV_BYTES):
        raise ConfigError(f"{arg}: expected a non-empty list of strings of at most {MAX_ARGV_BYTES} bytes")


def _strings(arg: str, v: Any) -> None:
    if not isinstance(v, list) or not all(isinstance(a, str) for a in v) or len(v) > 256:
        raise ConfigError(f"{arg}: expected a list of at most 256 strings")


def _b64(arg: str, v: Any) -> None:
    if not isinstance(v, str) or len(v) > MAX_STDIN_B64_BYTES:
        raise ConfigError(f"{arg}: expected base64 text of at most {MAX_STDIN_B64_BYTES} bytes")


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:40] + "..."


# By argument name; ``None`` is accepted for every optional argument (its default applies).
CHECKS: dict[str, Callable[[str, Any], None]] = {
    "name": _name("name"),
    "template": _name("template name"),
    "sharing_domain": _name("sharing domain"),
    "names": _names,
    "name_prefix": _prefix,
    "count": _int(1, MAX_CLONES_PER_REQUEST),
    "mem_mib": _int(64, 1 << 20),
    "vcpus": _int(1, 256),
    "pressure_budget_bytes": _int(0, 1 << 60),
    "timeout_s": _seconds(0.0, MAX_TIMEOUT_S, open_lo=True),
    "grace_s": _seconds(0.0, MAX_TIMEOUT_S),
    "since": _seconds(0.0, 1e12),
    "prefetch": _bool,
    "reset": _bool,
    "policy": _str,
    "phase": _str,
    "ram_mode": _str,
    "argv": _argv,
    "warmup": _strings,
    "stdin_b64": _b64,
    "kind": _name("call kind"),
}


def check_args(op: str, args: dict[str, Any]) -> None:
    """Raise ConfigError for the first argument that is not acceptable. Arguments no check
    knows are left to the request models (an unknown one is a RequestInvalid there)."""
    for arg, value in args.items():
        check = CHECKS.get(arg)
        if check is not None and value is not None:
            try:
                check(arg, value)
            except ConfigError as exc:
                raise ConfigError(f"{op}: {exc}") from None
