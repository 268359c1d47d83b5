"""Files into and out of a sandbox (``PUT``/``GET /v1/sandboxes/{name}/files``), size-capped.

They travel through the guest agent like any tool call (``Manager.op_exec``: a sandbox that
azqemu compressed is resumed first, and the scheduler sees a tool call): a put is ``cat >``
(then ``cat >>``) with the bytes on its standard input, in chunks, then a rename; a get is
``cat PATH`` after a size check in the guest. The path is an argument of the shell, never part of its script. Both are capped at
``MAX_FILE_BYTES``, the guest agent's own output limit (``agent.MAX_OUTPUT_BYTES``); a larger
file or upload is ``PayloadTooLarge`` (413) and nothing is written.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any

from azqemu.agent import MAX_OUTPUT_BYTES
from azqemu.errors import AzqemuError, ConfigError, GuestFileError, GuestFileNotFound, PayloadTooLarge

MAX_FILE_BYTES = MAX_OUTPUT_BYTES
MAX_PATH_CHARS = 4096
FILE_TIMEOUT_S = 120.0
_TOO_LARGE_EXIT = 3
_PUT = ['/bin/sh', '-c', 'cat > "$1"', "azq-put"]
_APPEND = ['/bin/sh', '-c', 'cat >> "$1"', "azq-put"]
_RENAME = ['/bin/mv', '-f', '--']
PART_SUFFIX = ".azq-part"
# qemu-ga parses a request's JSON (the chunk, base64) character by character in the guest:
# under TCG ~1.4 MB of it did not parse within the agent call's 10 s (agent.CALL_TIMEOUT_S).
# Chunks of this size keep each call at a fraction of that.
PUT_CHUNK_BYTES = 128 << 10
_GET = ['/bin/sh', '-c', 's=$(stat -L -c %s -- "$1") || exit 2; '
        'if [ "$s" -gt "$2" ]; then echo "$s bytes" >&2; exit 3; fi; exec cat -- "$1"', "azq-get"]


def check_path(path: str) -> str:
    if (not isinstance(path, str) or not path.startswith("/") or "\0" in path or len(path) > MAX_PATH_CHARS
            or path.endswith("/")):
        raise ConfigError(f"expected an absolute file path of at most {MAX_PATH_CHARS} characters, "
                          f"got {path[:80]!r}")
    return path


def _failed(name: str, path: str, res: dict[str, Any]) -> GuestFileError:
    detail = base64.b64decode(res.get("stderr_b64", "")).decode(errors="replace").strip().splitlines()
    text = detail[-1] if detail else f"exit code {res['exit_code']}"
    cls = GuestFileNotFound if "No such file" in text else GuestFileError
    return cls(name, path, text[:300])


def put(manager: Any, name: str, path: str, data: bytes) -> dict[str, Any]:
    """Write ``data`` in chunks to ``PATH.azq-part``, then rename it to ``PATH``: a reader never
    sees half a file, and a failed upload leaves none."""
    check_path(path)
    if len(data) > MAX_FILE_BYTES:
        raise PayloadTooLarge(f"the file for {path}", MAX_FILE_BYTES)
    part = path + PART_SUFFIX
    try:
        for i in range(0, max(len(data), 1), PUT_CHUNK_BYTES):
            script = _PUT if i == 0 else _APPEND
            res = manager.op_exec(name, [*script, part], timeout_s=FILE_TIMEOUT_S,
                                  stdin_b64=base64.b64encode(data[i:i + PUT_CHUNK_BYTES]).decode())
            if res["exit_code"] != 0:
                raise _failed(name, path, res)
        res = manager.op_exec(name, [*_RENAME, part, path], timeout_s=FILE_TIMEOUT_S)
        if res["exit_code"] != 0:
            raise _failed(name, path, res)
    except BaseException:
        with contextlib.suppress(AzqemuError):
            manager.op_exec(name, ["/bin/rm", "-f", "--", part], timeout_s=FILE_TIMEOUT_S)
        raise
    return {"name": name, "path": path, "size_bytes": len(data)}


def get(manager: Any, name: str, path: str) -> bytes:
    check_path(path)
    res = manager.op_exec(name, [*_GET, path, str(MAX_FILE_BYTES)], timeout_s=FILE_TIMEOUT_S)
    if res["exit_code"] == _TOO_LARGE_EXIT:
        raise PayloadTooLarge(f"{path} in {name!r}", MAX_FILE_BYTES)
    if res["exit_code"] != 0:
        raise _failed(name, path, res)
    return base64.b64decode(res["stdout_b64"])
