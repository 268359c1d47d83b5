"""On-disk form of the page store's metadata: the store file and one index file per sandbox.

Both carry a magic, a version and an XXH64 checksum of their body, and every size read from
them is checked against the file's actual length before anything is allocated (Firecracker's
snapshot format is the model). A file without our magic or of another version is refused as
``StoreForeign``; a damaged one as ``StoreCorrupt``. Files are written whole to a temporary
name, fsynced, then renamed into place (rename(2)); ``sync_dir`` makes the renames durable. A
write that finds no room (ENOSPC, EDQUOT) raises ``StoreFull`` (azqemu.errors) and leaves no
temporary file.

    store.azq    "AZQSTORE" | u32 version | u32 flags | u64 json_len | u64 bin_len | u64 xxh64(body)
                 body = JSON (ids, domains, templates, sandboxes, arenas) + binary (blob table,
                 similarity indices, free blob ids as u32), the binary parts' lengths given in
                 the JSON. Version 3; version 2 (the free ids a JSON list) is still read
    sbx-<h>-g<gen>.azqidx (one per sandbox and generation; ``sbx-<h>.azqidx`` before version 2.1)
                 "AZQINDEX" | u32 version | u32 name_len | 16 bytes store uuid | u64 n_entries |
                 u64 n_raw | u64 map_len | u64 xxh64(body);  body = name (utf-8) | entries (10 B
                 each) | RAW page indices (u32 each) | 2-bit ZERO/TEMPLATE map
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from azqemu.errors import StoreCorrupt, StoreForeign
from azqemu.errors import StoreFull as StoreFull  # re-exported: it lives in errors.py's tree
from azqemu.memory.kinds import ENTRY_DTYPE

STORE_MAGIC = b"AZQSTORE"
INDEX_MAGIC = b"AZQINDEX"
FORMAT_VERSION = 2      # 2: sandbox index = 2-bit map + 10-byte entries
# The store file: 3 moved the free blob ids out of the JSON (a list of tens of thousands of ints,
# dumped at every commit) into the binary part, as u32 ("free_count" in the JSON).
STORE_FORMAT_VERSION = 3
STORE_READABLE_VERSIONS = (2, 3)
_STORE_HEAD = struct.Struct("<8sIIQQQ")
_INDEX_HEAD = struct.Struct("<8sII16sQQQQ")
MAX_JSON_BYTES = 64 << 20
MAX_NAME_BYTES = 4096
STORE_FILE = "store.azq"
TMP_SUFFIX = ".tmp"


def is_no_space(err: OSError) -> bool:
    return err.errno in (errno.ENOSPC, errno.EDQUOT)


def _atomic_write(path: Path, parts: list[bytes | memoryview]) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            for p in parts:
                view = memoryview(p).cast("B")
                while len(view):
                    n = os.write(fd, view)
                    view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if is_no_space(err):
            raise StoreFull(str(path), "no room to write the file") from err
        raise


# Space held back for a commit when the file system is full: a store full of durable data
# can only free space by committing a generation that no longer names it, and that commit
# needs room for the store file and the changed indices (36 + 24 bytes per blob, 10 per
# entry: 4 MiB covers ~60,000 blobs). Released when a flush hits ENOSPC, taken back after.
RESERVE_FILE = "reserve.azq"
RESERVE_BYTES = 4 << 20


def ensure_reserve(root: Path) -> bool:
    """Hold RESERVE_BYTES in ``root`` (allocated, not sparse); False if there is no room now."""
    path = root / RESERVE_FILE
    try:
        if path.exists() and path.stat().st_blocks * 512 >= RESERVE_BYTES:
            return True
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)
        return True
    except OSError as err:
        if not is_no_space(err):
            raise
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        return False


def release_reserve(root: Path) -> bool:
    """Give the reserve back to the file system; False if there was none."""
    try:
        (root / RESERVE_FILE).unlink()
        return True
    except FileNotFoundError:
        return False


def sync_dir(path: Path) -> None:
    """fsync(2) a directory: the renames and unlinks in it are durable afterwards."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_all(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise StoreCorrupt(str(path), f"cannot read: {err.strerror}") from err


def write_store(path: Path, meta: dict[str, Any], binary: list[bytes | memoryview]) -> None:
    js = json.dumps(meta, sort_keys=True).encode()
    bin_len = sum(memoryview(b).nbytes for b in binary)
    h = xxhash.xxh64(js)
    for b in binary:
        h.update(b)
    head = _STORE_HEAD.pack(STORE_MAGIC, STORE_FORMAT_VERSION, 0, len(js), bin_len, h.intdigest())
    _atomic_write(path, [head, js, *binary])


def read_store(path: Path) -> tuple[dict[str, Any], memoryview]:
    data = _read_all(path)
    if len(data) < _STORE_HEAD.size or data[:8] != STORE_MAGIC:
        raise StoreForeign(str(path), "no page-store magic")
    _, version, _flags, js_len, bin_len, digest = _STORE_HEAD.unpack_from(data)
    if version not in STORE_READABLE_VERSIONS:
        raise StoreForeign(str(path), f"format version {version}, this azqemu reads {STORE_READABLE_VERSIONS}")
    if js_len > MAX_JSON_BYTES or _STORE_HEAD.size + js_len + bin_len != len(data):
        raise StoreCorrupt(str(path), "section sizes do not match the file")
    body = memoryview(data)[_STORE_HEAD.size:]
    if xxhash.xxh64_intdigest(body) != digest:
        raise StoreCorrupt(str(path), "checksum mismatch")
    try:
        meta = json.loads(bytes(body[:js_len]))
    except ValueError as err:
        raise StoreCorrupt(str(path), "unreadable metadata") from err
    if not isinstance(meta, dict):
        raise StoreCorrupt(str(path), "metadata is not an object")
    return meta, body[js_len:]


def index_file_name(sandbox: str, generation: int | None = None) -> str:
    """The index file of ``sandbox`` written by ``generation`` (None: the unversioned name
    of stores written before generations were numbered, still read)."""
    h = xxhash.xxh64_hexdigest(sandbox.encode())
    return f"sbx-{h}.azqidx" if generation is None else f"sbx-{h}-g{generation}.azqidx"


def is_index_file_name(name: str) -> bool:
    """A plain file name of ours (a store file naming anything else is refused)."""
    return (name.startswith("sbx-") and name.endswith(".azqidx") and "/" not in name
            and name not in (".", "..") and len(name) < 128)


def write_index(path: Path, store_uuid: bytes, sandbox: str, records: np.ndarray, raw: np.ndarray,
                zt_map: bytes | bytearray = b"") -> None:
    name = sandbox.encode()
    rec = np.ascontiguousarray(records, dtype=ENTRY_DTYPE)
    rw = np.ascontiguousarray(raw, dtype="<u4")
    digest = xxhash.xxh64(name)
    digest.update(rec.tobytes())
    digest.update(rw.tobytes())
    digest.update(bytes(zt_map))
    head = _INDEX_HEAD.pack(INDEX_MAGIC, FORMAT_VERSION, len(name), store_uuid, len(rec), len(rw), len(zt_map),
                            digest.intdigest())
    _atomic_write(path, [head, name, rec.tobytes(), rw.tobytes(), bytes(zt_map)])


def read_index(path: Path, store_uuid: bytes) -> tuple[str, np.ndarray, np.ndarray, bytes]:
    data = _read_all(path)
    if len(data) < _INDEX_HEAD.size or data[:8] != INDEX_MAGIC:
        raise StoreForeign(str(path), "no sandbox-index magic")
    _, version, name_len, uuid, n_entries, n_raw, map_len, digest = _INDEX_HEAD.unpack_from(data)
    if version != FORMAT_VERSION:
        raise StoreForeign(str(path), f"index version {version}, this azqemu reads {FORMAT_VERSION}")
    if uuid != store_uuid:
        raise StoreForeign(str(path), "index belongs to another store")
    size = len(data) - _INDEX_HEAD.size
    # Bound every count by the file's real size before computing offsets with it.
    if (name_len > MAX_NAME_BYTES or n_entries > size // ENTRY_DTYPE.itemsize or n_raw > size // 4
            or map_len > size or name_len + n_entries * ENTRY_DTYPE.itemsize + n_raw * 4 + map_len != size):
        raise StoreCorrupt(str(path), "section sizes do not match the file")
    body = memoryview(data)[_INDEX_HEAD.size:]
    if xxhash.xxh64_intdigest(body) != digest:
        raise StoreCorrupt(str(path), "checksum mismatch")
    try:
        name = bytes(body[:name_len]).decode()
    except UnicodeDecodeError as err:
        raise StoreCorrupt(str(path), "bad sandbox name") from err
    off = name_len
    rec = np.frombuffer(body, dtype=ENTRY_DTYPE, count=n_entries, offset=off).copy()
    off += n_entries * ENTRY_DTYPE.itemsize
    raw = np.frombuffer(body, dtype="<u4", count=n_raw, offset=off).copy()
    off += n_raw * 4
    return name, rec, raw, bytes(body[off:off + map_len])
