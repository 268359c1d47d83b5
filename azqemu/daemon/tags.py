"""Labels and a time to live on sandboxes (set at clone, ``PATCH /v1/sandboxes/{name}``).

Labels are an orchestrator's own key/value pairs (``task=42``, ``tenant=acme``): ``azq list
--label task=42`` and ``GET /v1/sandboxes?label=task=42`` filter by them. A time to live makes a
sandbox expire: the reaper destroys it through the manager's own ``op_destroy`` (the normal
path: its memory is released, its record removed) once ``expires_at`` has passed.

Both are kept in one JSON file in the state directory (``api-tags.json``, written atomically:
a temporary file, fsync, rename) so they survive a daemon restart, beside the sandbox records
they annotate; a sandbox that goes away by any path loses its tags at the next write (``prune``)
and a new clone of the same name starts with its own.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import threading
import time
from pathlib import Path
from typing import Any

from azqemu.errors import AzqemuError, ConfigError, SandboxNotFound

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
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._tags: dict[str, dict[str, Any]] = self._load()

    def _load(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("%s unreadable (%s): sandboxes start without labels and TTLs", self.path, exc)
            return {}
        return {str(k): v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}

    def _save(self) -> None:
        """The caller holds the lock."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(self._tags, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def assign(self, name: str, labels: dict[str, str] | None = None, ttl_s: float | None = None, *,
            replace: bool = True) -> dict[str, Any]:
        """Labels (all of them when ``replace``, else merged; an empty value removes a key) and a
        TTL from now (None: keep the one there is, unless ``replace``)."""
        labels = check_labels(labels or {})
        check_ttl(ttl_s)
        with self._lock:
            cur = {} if replace else dict(self._tags.get(name, {}))
            merged: dict[str, str] = {} if replace else dict(cur.get("labels", {}))
            merged.update(labels)
            kept = check_labels({k: v for k, v in merged.items() if v != "" or replace})
            expires_at = (time.time() + ttl_s) if ttl_s is not None else cur.get("expires_at")
            entry: dict[str, Any] = {"labels": kept, "expires_at": expires_at}
            self._tags[name] = entry
            self._save()
            return dict(entry)

    def get(self, name: str) -> dict[str, Any]:
        with self._lock:
            entry = self._tags.get(name, {})
            return {"labels": dict(entry.get("labels", {})), "expires_at": entry.get("expires_at")}

    def forget(self, name: str) -> None:
        with self._lock:
            if self._tags.pop(name, None) is not None:
                self._save()

    def prune(self, alive: set[str]) -> None:
        """Drop the tags of sandboxes that no longer exist."""
        with self._lock:
            gone = [n for n in self._tags if n not in alive]
            for n in gone:
                del self._tags[n]
            if gone:
                self._save()

    def expired(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        with self._lock:
            return [n for n, e in self._tags.items() if e.get("expires_at") is not None and e["expires_at"] <= now]


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
        self._thread = threading.Thread(target=self._run, name="azq-ttl-reaper", daemon=True)
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
