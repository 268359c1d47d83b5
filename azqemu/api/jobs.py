"""Long operations as jobs: start one, get its id at once, poll it or wait on it.

A template build takes minutes; holding an HTTP request (and a client) for that long is what
the JSON-lines protocol did. ``Jobs.start`` runs the operation in a thread of its own and
returns a ``Job`` in state ``running``; ``get(id, wait_s)`` returns it, after waiting up to
``wait_s`` for it to finish. Finished jobs are kept for ``KEEP_FINISHED_S`` (a client that
comes back later still finds its result), at most ``MAX_JOBS`` in all (the oldest finished go
first). Jobs live in the daemon's memory: a daemon restart forgets them (the operation itself
is then interrupted like any other request; see docs/api.md).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from azqemu.api.errors import error_info
from azqemu.api.models import Job
from azqemu.errors import ApiNotFound, DaemonBusy
from azqemu.host.threads import os_named

KEEP_FINISHED_S = 3600.0
MAX_JOBS = 256
MAX_RUNNING = 8            # each holds a thread; a template build is CPU-bound under TCG anyway
MAX_WAIT_S = 600.0


class _Entry:
    def __init__(self, kind: str) -> None:
        self.job = Job(id=uuid.uuid4().hex, kind=kind, state="running", created_at=time.time())
        self.done = threading.Event()


class Jobs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, _Entry] = {}

    def start(self, kind: str, fn: Callable[[], Any]) -> Job:
        with self._lock:
            self._expire()
            if sum(1 for e in self._jobs.values() if not e.done.is_set()) >= MAX_RUNNING:
                raise DaemonBusy(MAX_RUNNING)
            entry = _Entry(kind)
            self._jobs[entry.job.id] = entry

        def run() -> None:
            try:
                result = fn()
                update: dict[str, Any] = {"state": "succeeded", "result": result}
            except BaseException as exc:  # noqa: BLE001 - the job records every failure
                update = {"state": "failed", "error": error_info(exc)}
            update["finished_at"] = time.time()
            with self._lock:
                entry.job = entry.job.model_copy(update=update)
            entry.done.set()

        threading.Thread(target=os_named(run), name=f"azq-job-{kind}", daemon=True).start()
        return entry.job

    def get(self, job_id: str, wait_s: float = 0.0) -> Job:
        with self._lock:
            entry = self._jobs.get(job_id)
        if entry is None:
            raise ApiNotFound(f"no job {job_id[:64]!r}", path=f"/v1/jobs/{job_id[:64]}")
        if wait_s > 0:
            entry.done.wait(min(wait_s, MAX_WAIT_S))
        with self._lock:
            return entry.job

    def list(self) -> list[Job]:
        with self._lock:
            self._expire()
            return [e.job for e in self._jobs.values()]

    def _expire(self) -> None:
        """The caller holds the lock."""
        now = time.time()
        for jid, e in list(self._jobs.items()):
            if e.done.is_set() and now - (e.job.finished_at or now) > KEEP_FINISHED_S:
                del self._jobs[jid]
        finished = sorted((e.job.finished_at or 0.0, jid) for jid, e in self._jobs.items() if e.done.is_set())
        while len(self._jobs) > MAX_JOBS and finished:
            del self._jobs[finished.pop(0)[1]]
