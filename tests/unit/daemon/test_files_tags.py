"""Files in and out of a guest (daemon/files.py: paths, chunks, the rename, the caps) and the
API's labels and time to live (daemon/tags.py: checks, merge, kept in the records, expiry, the
move from an older daemon's api-tags.json)."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest

from azqemu.daemon import files
from azqemu.daemon.registry import Registry
from azqemu.daemon.tags import SandboxTags, check_labels, matches, migrate_legacy, parse_selector
from azqemu.errors import ConfigError, GuestFileError, GuestFileNotFound, PayloadTooLarge, SandboxNotFound
from azqemu.virt.clones import SandboxRecord, SandboxRepo


class GuestShell:
    """What files.py asks of the manager (op_exec), run against a dict of guest files."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fs: dict[str, bytes] = {}
        self.calls: list[list[str]] = []
        self.fail_at = fail_at

    def op_exec(self, name: str, argv: list[str], timeout_s: float = 0, stdin_b64: str | None = None) -> dict[str, Any]:
        self.calls.append(argv)
        data = base64.b64decode(stdin_b64 or "")
        err = b""
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            code, err = 1, b"sh: 1: cannot create /ro/x.azq-part: Read-only file system\n"
        elif argv[:3] == ["/bin/sh", "-c", 'cat > "$1"']:
            self.fs[argv[4]], code = data, 0
        elif argv[:3] == ["/bin/sh", "-c", 'cat >> "$1"']:
            self.fs[argv[4]], code = self.fs[argv[4]] + data, 0
        elif argv[0] == "/bin/mv":
            self.fs[argv[4]], code = self.fs.pop(argv[3]), 0
        elif argv[0] == "/bin/rm":
            self.fs.pop(argv[3], None)
            code = 0
        else:   # the get script: size check, then cat
            path, limit = argv[4], int(argv[5])
            if path not in self.fs:
                return {"exit_code": 2, "stdout_b64": "", "stderr_b64": base64.b64encode(
                    f"stat: cannot statx '{path}': No such file or directory\n".encode()).decode()}
            code = 3 if len(self.fs[path]) > limit else 0
            return {"exit_code": code, "stdout_b64": base64.b64encode(self.fs[path] if not code else b"").decode(),
                    "stderr_b64": ""}
        return {"exit_code": code, "stdout_b64": "", "stderr_b64": base64.b64encode(err).decode()}


@pytest.mark.parametrize("bad", ["relative", "", "/tmp/", "/a\0b", "/" + "x" * 5000])
def test_paths_must_be_absolute_files(bad: str) -> None:
    with pytest.raises(ConfigError, match="absolute file path"):
        files.check_path(bad)


def test_put_in_chunks_then_a_rename_and_get_back() -> None:
    g = GuestShell()
    data = bytes(range(256)) * (files.PUT_CHUNK_BYTES * 3 // 256 + 7)
    assert files.put(g, "a-0", "/tmp/f", data) == {"name": "a-0", "path": "/tmp/f", "size_bytes": len(data)}
    assert g.fs == {"/tmp/f": data}
    assert len(g.calls) == 4 + 1 and g.calls[-1][0] == "/bin/mv"
    assert files.get(g, "a-0", "/tmp/f") == data
    files.put(g, "a-0", "/tmp/empty", b"")
    assert g.fs["/tmp/empty"] == b""


def test_a_failed_put_leaves_no_part_file() -> None:
    g = GuestShell(fail_at=2)
    with pytest.raises(GuestFileError, match="Read-only file system") as exc:
        files.put(g, "a-0", "/ro/x", b"y" * (files.PUT_CHUNK_BYTES + 1))
    assert (exc.value.name, exc.value.path) == ("a-0", "/ro/x")
    assert g.fs == {} and g.calls[-1][0] == "/bin/rm"


def test_sizes_are_capped_both_ways_and_missing_files_are_404s() -> None:
    g = GuestShell()
    with pytest.raises(PayloadTooLarge):
        files.put(g, "a-0", "/tmp/big", b"x" * (files.MAX_FILE_BYTES + 1))
    assert g.calls == []
    g.fs["/tmp/big"] = b"x" * (files.MAX_FILE_BYTES + 1)
    with pytest.raises(PayloadTooLarge):
        files.get(g, "a-0", "/tmp/big")
    with pytest.raises(GuestFileNotFound, match="No such file"):
        files.get(g, "a-0", "/tmp/none")


def _record(registry: Registry, name: str, **kw: Any) -> SandboxRecord:
    rec = SandboxRecord(name=name, template="base", sharing_domain="default", ram_mode="eager",
                        uuid=f"uuid-{name}", created_at=time.time(), **kw)
    registry.sandboxes.save(rec)
    return rec


def test_labels_merge_replace_persist_in_the_record_and_expire(registry: Registry) -> None:
    for n in ("a", "b"):
        _record(registry, n)
    tags = SandboxTags(registry)
    tags.assign("a", {"task": "1", "team": "x"}, ttl_s=None)
    assert tags.assign("a", {"team": "", "more": "2"}, replace=False)["labels"] == {"task": "1", "more": "2"}
    assert tags.assign("a", {"only": "3"})["labels"] == {"only": "3"}
    tags.assign("b", {}, ttl_s=0.01)
    with pytest.raises(SandboxNotFound):
        tags.assign("nope", {"a": "b"})
    # A new daemon (a new SandboxTags over new books) reads them from the records.
    assert registry.sandboxes.get("a").labels == {"only": "3"}
    again = SandboxTags(Registry(registry.cfg, registry.host, registry.templates, SandboxRepo(registry.cfg)))
    assert again.get("a") == {"labels": {"only": "3"}, "expires_at": None}
    time.sleep(0.02)
    assert again.expired() == ["b"]
    # b destroyed by another path, and a new b without a TTL: its old lease is not the new one's.
    registry.sandboxes.remove("b")
    _record(registry, "b")
    assert again.expired() == [] and again.get("b") == {"labels": {}, "expires_at": None}


def test_api_tags_json_moves_into_the_records_once(registry: Registry, tmp_path: Path) -> None:
    _record(registry, "a")
    _record(registry, "own", labels={"mine": "1"})
    _record(registry, "bad")
    legacy = tmp_path / "api-tags.json"
    legacy.write_text(json.dumps({
        "a": {"labels": {"task": "42"}, "expires_at": 4102444800.0},
        "gone": {"labels": {"x": "1"}, "expires_at": None},          # no record: dropped
        "own": {"labels": {"old": "1"}, "expires_at": None},          # the record's own win
        "bad": {"labels": {"bad key": "v"}, "expires_at": "soon"},    # not valid: dropped
        "worse": "not an entry"}))
    tags = SandboxTags(registry, legacy_path=legacy)
    assert not legacy.exists()
    assert registry.sandboxes.get("a").labels == {"task": "42"} and registry.sandboxes.get("a").expires_at == 4102444800.0
    assert tags.get("own")["labels"] == {"mine": "1"} and tags.get("bad") == {"labels": {}, "expires_at": None}
    assert tags.expired(now=4102444800.0) == ["a"]
    assert migrate_legacy(registry, legacy) == 0     # gone: nothing to do the second time
    legacy.write_text("{not json")
    assert migrate_legacy(registry, legacy) == 0 and legacy.exists()   # unreadable: left in place


@pytest.mark.parametrize("labels", [{"bad key": "v"}, {"": "v"}, {"k": "x" * 300}, {"k": "a\nb"},
                                    {f"k{i}": "v" for i in range(40)}])
def test_bad_labels_are_config_errors(labels: dict[str, str]) -> None:
    with pytest.raises(ConfigError):
        check_labels(labels)


def test_selectors() -> None:
    t = {"labels": {"task": "42", "team": "a"}}
    assert matches(t, [parse_selector("task=42"), parse_selector("team")])
    assert not matches(t, [parse_selector("task=4")])
    with pytest.raises(ConfigError):
        parse_selector("=x")
