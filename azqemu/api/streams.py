"""Streamed responses as JSON lines (application/x-ndjson): ``GET /v1/events?follow=true``
and ``POST /v1/sandboxes/{name}/exec/stream``.

The daemon's events are kept in memory by its event log (``daemon/eventlog.py``); a follower
waits on it in the event loop (``EventLog.wait_async``: woken by each new event, no thread
held, no polling) and writes each new one as a line, in ``seq`` order (times may tie). An
empty line every ``HEARTBEAT_S`` keeps proxies and the client's read timeout from closing a
quiet stream, and lets the server notice a client that left. The stream ends when the
client disconnects or the daemon stops.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

from fastapi.responses import StreamingResponse

from azqemu.daemon.eventlog import EventLog

HEARTBEAT_S = 15.0
NDJSON = "application/x-ndjson"


async def _follow(log: EventLog, since: float, sandbox: str | None,
                  kinds: Collection[str] | None) -> AsyncIterator[bytes]:
    after_seq = 0
    last_write = time.monotonic()
    while True:
        seen = log.last_seq    # events published from here on go out in the next round
        for e in log.events(since, after_seq=after_seq, sandbox=sandbox, kinds=kinds):
            if e["seq"] <= seen:
                yield _line(e)
                last_write = time.monotonic()
        # Filtered out or sent: not looked at again. ``since`` only picks the backlog: a
        # clock stepped back must not hide new events.
        after_seq, since = seen, 0.0
        left_s = HEARTBEAT_S - (time.monotonic() - last_write)
        if left_s <= 0 or not await log.wait_async(after_seq, left_s):
            if time.monotonic() - last_write >= HEARTBEAT_S:
                yield b"\n"
                last_write = time.monotonic()


def events_response(log: EventLog, since: float, *, sandbox: str | None = None,
                    kinds: Collection[str] | None = None) -> StreamingResponse:
    return StreamingResponse(_follow(log, since, sandbox, kinds), media_type=NDJSON,
                             headers={"Cache-Control": "no-store"})


# -- exec as a stream ------------------------------------------------------------------------
# The QEMU guest agent hands over a command's output only once it has exited (guest-exec-status
# carries out-data/err-data when "exited" is true), so the stream cannot carry output while the
# command runs: it says the command started, that it is still running (every EXEC_BEAT_S), then
# its stdout and stderr in chunks and its exit. An azqemu failure after the 200 status is the
# last line, as the API's error object.
EXEC_BEAT_S = 5.0
CHUNK_BYTES = 1 << 20


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def _exec_frames(run: Callable[[], dict[str, Any]],
                       error_body: Callable[[BaseException], dict[str, Any]]) -> AsyncIterator[bytes]:
    from anyio import to_thread

    t0 = time.monotonic()
    task = asyncio.ensure_future(to_thread.run_sync(run))
    yield _line({"event": "started"})
    while True:
        done, _ = await asyncio.wait({task}, timeout=EXEC_BEAT_S)
        if done:
            break
        yield _line({"event": "running", "elapsed_s": round(time.monotonic() - t0, 3)})
    try:
        res = task.result()
    except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
        yield _line({"event": "error", **error_body(exc)})
        return
    for stream in ("stdout", "stderr"):
        data = res[f"{stream}_b64"]
        step = CHUNK_BYTES * 4 // 3
        for i in range(0, len(data), step):
            yield _line({"event": stream, "data_b64": data[i:i + step]})
    yield _line({"event": "exit", **{k: v for k, v in res.items() if not k.endswith("_b64")}})


def exec_response(run: Callable[[], dict[str, Any]],
                  error_body: Callable[[BaseException], dict[str, Any]]) -> StreamingResponse:
    return StreamingResponse(_exec_frames(run, error_body), media_type=NDJSON, headers={"Cache-Control": "no-store"})
