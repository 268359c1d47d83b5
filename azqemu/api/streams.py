"""Streamed responses as JSON lines (application/x-ndjson): ``GET /v1/events?follow=true``
and ``POST /v1/sandboxes/{name}/exec/stream``.

The daemon's events are kept in memory by its event log (``daemon/eventlog.py``); a follower
waits on it in the event loop (``EventLog.wait_async``: woken by each new event, no thread
held, no polling) and writes each new one as a line, in ``seq`` order (times may tie). An
empty line every ``HEARTBEAT_S`` keeps proxies and the client's read timeout from closing a
quiet stream, and lets the server notice a client that left. The stream ends when the
client disconnects or the daemon stops.

A streamed exec carries the command's stdout and stderr while it runs (the guest agent
follows two files the command writes, ``azqemu/agent.py``), then its exit.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Collection
from typing import Any

import anyio
from anyio import from_thread, to_thread
from fastapi.responses import StreamingResponse

from azqemu.daemon.eventlog import EventLog

log = logging.getLogger(__name__)

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
# The command runs in a worker thread (the manager's op_exec with an output sink: the guest
# agent follows its output files, azqemu/agent.py); each chunk it reads crosses to the event
# loop through a bounded memory stream, so a slow client holds the reader back instead of
# the daemon buffering (and a client that left makes the next chunk fail, which kills the
# command). Lines: started, stdout/stderr chunks as they come, running every EXEC_BEAT_S
# without output, then exit. An azqemu failure after the 200 status is the last line, as the
# API's error object.
EXEC_BEAT_S = 5.0
# Chunks (of at most agent.STREAM_CHUNK_BYTES) waiting for the client: at most 4 MiB.
EXEC_QUEUE_CHUNKS = 16
# Output a run() captured rather than streamed goes out in lines of this much.
CHUNK_BYTES = 1 << 20

Sink = Callable[[str, bytes], None]


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _chunk(stream: str, data: bytes) -> bytes:
    return _line({"event": stream, "data_b64": base64.b64encode(data).decode()})


async def _exec_frames(run: Callable[[Sink], dict[str, Any]],
                       error_body: Callable[[BaseException], dict[str, Any]]) -> AsyncIterator[bytes]:
    send, recv = anyio.create_memory_object_stream[tuple[str, bytes]](EXEC_QUEUE_CHUNKS)

    def sink(stream: str, data: bytes) -> None:   # in the worker thread
        from_thread.run(send.send, (stream, data))   # BrokenResourceError once the client left

    def work() -> dict[str, Any]:
        try:
            return run(sink)
        finally:
            from_thread.run_sync(send.close)

    t0 = time.monotonic()
    task = asyncio.ensure_future(to_thread.run_sync(work))
    pending: asyncio.Future[tuple[str, bytes]] | None = None
    try:
        yield _line({"event": "started"})
        while True:
            # One receive at a time, kept across heartbeats (a cancelled receive could lose a chunk).
            pending = pending or asyncio.ensure_future(recv.receive())
            done, _ = await asyncio.wait({pending}, timeout=EXEC_BEAT_S)
            if not done:
                yield _line({"event": "running", "elapsed_s": round(time.monotonic() - t0, 3)})
                continue
            fut, pending = pending, None
            try:
                stream, data = fut.result()
            except anyio.EndOfStream:
                break
            yield _chunk(stream, data)
        try:
            res = await task
        except Exception as exc:  # noqa: BLE001 - reported in-band: the status line is already sent
            yield _line({"event": "error", **error_body(exc)})
            return
        for stream in ("stdout", "stderr"):   # streamed already, unless run() captured them
            raw = base64.b64decode(res.get(f"{stream}_b64") or "")
            for i in range(0, len(raw), CHUNK_BYTES):
                yield _chunk(stream, raw[i:i + CHUNK_BYTES])
        yield _line({"event": "exit", **{k: v for k, v in res.items() if not k.endswith("_b64")}})
    finally:
        if pending is not None:
            pending.cancel()
        recv.close()
        if not task.done():   # the client left: the command is stopped at its next chunk
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.info("a streamed exec ended after its client left: %s", task.exception())


def exec_response(run: Callable[[Sink], dict[str, Any]],
                  error_body: Callable[[BaseException], dict[str, Any]]) -> StreamingResponse:
    """``run(sink)`` runs the command and calls ``sink(stream, data)`` with its output as it comes."""
    return StreamingResponse(_exec_frames(run, error_body), media_type=NDJSON, headers={"Cache-Control": "no-store"})
