"""Labels and a time to live on sandboxes (set at clone, ``PATCH /v1/sandboxes/{name}``).

Labels are an orchestrator's own key/value pairs (``task=42``, ``tenant=acme``): ``azq list
--label task=42`` and ``GET /v1/sandboxes?label=task=42`` filter by them. A time to live makes a
sandbox expire: the reaper destroys it through the manager's own ``op_destroy`` (the normal
path: its memory is released, its record removed) once ``expires_at`` has passed.

Both are fields of the sandbox's record (``SandboxRecord.labels``, ``expires_at``, written
with the rest of it by the registry), so they survive a daemon restart and go away with the
sandbox by whatever path it goes; a new clone of the same name starts with its own. Daemons
before this kept them in ``api-tags.json`` in the state directory: ``migrate_legacy`` moves
that file's entries into the records once, at start, and removes it.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from pathlib import Path
from typing import Any

from azqemu.daemon.registry import Registry
from azqemu.errors import AzqemuError, ConfigError, SandboxNotFound
from azqemu.host.threads import os_named

log = logging.getLogger(__name__)

MAX_LABELS = 32
MAX_VALUE_CHARS = 256
MAX_TTL_S = 365 * 86400.0
_KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,62}")
# How often the reaper looks for expired sandboxes: a TTL is a lease, not a timer.
REAP_INTERVAL_S = 1.0


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > MAX_LABELS:
        raise ConfigError(f"at most {MAX_LABELS} labels per sandbox")
    for k, v in labels.items():
        if not _KEY_RE.fullmatch(k):
            raise ConfigError(f"invalid label key {k[:70]!r}: 1-63 characters from A-Z a-z 0-9 . _ / -")
        if len(v) > MAX_VALUE_CHARS or not v.isprintable():
            raise ConfigError(f"label {k}: the value must be printable, at most {MAX_VALUE_CHARS} characters")
    return dict(labels)


def check_ttl(ttl_s: float | None) -> float | None:
    if ttl_s is not None and not (math.isfinite(ttl_s) and 0 < ttl_s <= MAX_TTL_S):
        raise ConfigError(f"ttl_s: expected seconds above 0, at most {MAX_TTL_S:g}")
    return ttl_s


def parse_selector(selector: str) -> tuple[str, str | None]:
    """``key=value`` (that value) or ``key`` (any value)."""
    key, sep, value = selector.partition("=")
    if not _KEY_RE.fullmatch(key):
        raise ConfigError(f"invalid label selector {selector[:70]!r} (KEY or KEY=VALUE)")
    return key, (value if sep else None)


class SandboxTags:
    """Labels and time to live of the sandboxes, in their records.

    The expiry times are also kept in memory (the reaper asks every second; reading every
    record that often would cost more than it needs), and checked against the record before
    a sandbox is reaped: a name destroyed and cloned again must not inherit its old lease.
    """

    def __init__(self, registry: Registry, legacy_path: Path | None = None) -> None:
        self.reg = registry
        self._lock = threading.Lock()   # assign's read-merge-write, and the expiry table
        if legacy_path is not None:
            migrate_legacy(registry, legacy_path)
        self._expiry: dict[str, float] = {r.name: r.expires_at for r in registry.sandboxes.list()
                                          if r.expires_at is not None}

    def assign(self, name: str, labels: dict[str, str] | None = None, ttl_s: float | None = None, *,
               replace: bool = True) -> dict[str, Any]:
        """Labels (all of them when ``replace``, else merged; an empty value removes a key) and a
        TTL from now (None: keep the one there is, unless ``replace``). SandboxNotFound if the
        sandbox has no record."""
        labels = check_labels(labels or {})
        check_ttl(ttl_s)
        with self._lock:
            cur = self.reg.record(name)
            merged: dict[str, str] = {} if replace else dict(cur.labels)
            merged.update(labels)
            kept = check_labels({k: v for k, v in merged.items() if v != "" or replace})
            expires_at = (time.time() + ttl_s) if ttl_s is not None else (None if replace else cur.expires_at)
            if self.reg.update_record(name, labels=kept, expires_at=expires_at) is None:
                raise SandboxNotFound(name)
            if expires_at is None:
                self._expiry.pop(name, None)
            else:
                self._expiry[name] = expires_at
            return {"labels": dict(kept), "expires_at": expires_at}

    def get(self, name: str) -> dict[str, Any]:
        """The sandbox's labels and expiry (none for a sandbox without a record)."""
        try:
            rec = self.reg.record(name)
        except SandboxNotFound:
            return {"labels": {}, "expires_at": None}
        return {"labels": dict(rec.labels), "expires_at": rec.expires_at}

    def expired(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        with self._lock:
            due = [n for n, t in self._expiry.items() if t <= now]
        out = []
        for name in due:
            try:
                rec = self.reg.record(name)
            except SandboxNotFound:
                rec = None
            if rec is not None and rec.expires_at is not None and rec.expires_at <= now:
                out.append(name)
            else:   # gone by another path, or a new sandbox of that name: not this lease
                self.forget(name)
        return out

    def forget(self, name: str) -> None:
        """Stop watching ``name``'s lease (its record goes with the sandbox)."""
        with self._lock:
            self._expiry.pop(name, None)


def migrate_legacy(registry: Registry, path: Path) -> int:
    """Move the labels and TTLs an older daemon kept in ``api-tags.json`` into the records, then
    remove the file; returns how many sandboxes got theirs. A record that has labels or a TTL
    of its own keeps them (so a second run after a crash here changes nothing); entries of
    sandboxes without a record, or that are not valid, are dropped with a warning. A file that
    cannot be read is left where it is."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return 0
    except (OSError, ValueError, RecursionError) as exc:
        log.warning("%s unreadable (%s): left in place, its labels and TTLs not moved", path, exc)
        return 0
    moved = 0
    for name, entry in (data.items() if isinstance(data, dict) else ()):
        try:
            labels = check_labels(dict(entry.get("labels") or {}))
            expires_at = entry.get("expires_at")
            if expires_at is not None and (isinstance(expires_at, bool) or not isinstance(expires_at, int | float)
                                           or not math.isfinite(expires_at)):
                raise ConfigError("expires_at must be a unix time")
            rec = registry.record(str(name))
        except SandboxNotFound:
            log.warning("%s: %r has no record any more: its labels are dropped", path, name)
            continue
        except (AttributeError, TypeError, ValueError, AzqemuError) as exc:
            log.warning("%s: the entry of %r is not valid (%s): dropped", path, name, exc)
            continue
        if rec.labels or rec.expires_at is not None:
            continue
        registry.update_record(rec.name, labels=labels,
                               expires_at=float(expires_at) if expires_at is not None else None)
        moved += 1
    path.unlink(missing_ok=True)
    log.info("moved the labels and TTLs of %d sandbox(es) from %s into their records", moved, path)
    return moved


def matches(tags: dict[str, Any], selectors: list[tuple[str, str | None]]) -> bool:
    labels = tags.get("labels", {})
    return all(k in labels and (v is None or labels[k] == v) for k, v in selectors)


class TtlReaper:
    """Destroys expired sandboxes through the manager, in a thread of its own."""

    def __init__(self, tags: SandboxTags, manager: Any, interval_s: float = REAP_INTERVAL_S) -> None:
        self.tags = tags
        self.manager = manager
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=os_named(self._run), name="azq-ttl-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.reap()

    def reap(self) -> list[str]:
        done = []
        for name in self.tags.expired():
            try:
                self.manager.op_destroy(name)
                log.info("sandbox %s: its time to live ended: destroyed", name)
                done.append(name)
            except SandboxNotFound:
                pass
            except AzqemuError as exc:   # tried again at the next round
                log.warning("sandbox %s: its time to live ended, but destroy failed: %s", name, exc)
                continue
            self.tags.forget(name)
        return done
