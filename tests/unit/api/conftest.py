"""The API served for real (uvicorn on a unix socket in a thread, with the daemon's own listener
set-up) over a manager whose libvirt host is the daemon tests' fake (tests/unit/daemon)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from azqemu import config as config_mod
from azqemu.api.app import make_app
from azqemu.api.guard import Guard, Limiter
from azqemu.client import Client
from azqemu.daemon import server as server_mod
from azqemu.daemon.manager import Manager
from azqemu.daemon.tags import SandboxTags
from tests.unit.daemon.conftest import cfg, host, sandbox_meta_of, template  # noqa: F401


@dataclass
class Served:
    manager: Manager
    socket_path: Path
    client: Client
    tags: SandboxTags


@contextlib.contextmanager
def serve_in_thread(app: Any, path: Path) -> Iterator[None]:
    sock = server_mod.bind_unix(path)
    server = server_mod._Server(server_mod._config(app))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture
def served(cfg: config_mod.Config, host: Any, sandbox_meta_of: Any, template: Any) -> Iterator[Served]:  # noqa: F811
    host.add("a-0", sandbox_meta_of())
    manager = Manager(cfg, host=host)
    path = cfg.run_dir / "api.sock"
    path.parent.mkdir(parents=True, exist_ok=True)
    tags = SandboxTags(manager.registry, legacy_path=cfg.state_dir / "api-tags.json")
    with serve_in_thread(Guard(make_app(manager, tags=tags), limiter=Limiter()), path), Client(path) as client:
        yield Served(manager, path, client, tags)
