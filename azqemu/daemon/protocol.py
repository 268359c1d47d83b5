"""The daemon's wire protocol: one JSON object per line, both ways.

Request:  {"op": "clone", "args": {...}}
Reply:    {"ok": true, "result": ...}  or
          {"ok": false, "error": {"type": "SandboxNotFound", "message": "...", "exit_code": 1}}
Binary payloads (command output) travel base64-encoded. Lines are bounded.
"""

from __future__ import annotations

import json
from typing import Any

MAX_LINE_BYTES = 64 << 20


def encode(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("message is not an object")
    return obj
