"""Real services the integration tests start: Prometheus and OpenStack Placement.

Each runs on a free port with its own temporary directory, and is stopped by its pid.
Prometheus comes from Debian's ``prometheus`` package; Placement from its own venv
(``.placement-venv``, made by the Makefile) so its pins never meet the project's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from azqemu.daemon.proc import stop

REPO = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S = 20.0
PLACEMENT_VENV = Path(os.environ.get("AZQ_PLACEMENT_VENV", REPO / ".placement-venv"))

PLACEMENT_SERVE = """
import sys
from wsgiref.simple_server import WSGIRequestHandler, make_server
from placement import wsgi

class Quiet(WSGIRequestHandler):
    def log_message(self, *args):
        pass

srv = make_server("127.0.0.1", int(sys.argv[1]), wsgi.init_application(), handler_class=Quiet)
srv.serve_forever()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0,
              headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{proc.args!r} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing answered at {url} within {timeout_s:g} s:\n{log.read_text()[-3000:]}")


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]

    def query(self, expr: str) -> list[dict]:
        q = urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{q}", timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return list(body["data"]["result"])


@contextlib.contextmanager
def prometheus(target: str, workdir: Path) -> Iterator[Prometheus]:
    """A Prometheus server scraping ``target`` (host:port) every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise AssertionError("prometheus is not installed (the Makefile's APT_PACKAGES has it)")
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "prometheus.yml"
    cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                   "scrape_configs:\n  - job_name: azqemu\n    scrape_interval: 1s\n"
                   f"    static_configs:\n      - targets: ['{target}']\n")
    port = free_port()
    log = workdir / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={workdir / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/-/ready", proc, log)
        yield Prometheus(url, proc)
    finally:
        stop(proc, STOP_TIMEOUT_S)


@contextlib.contextmanager
def placement(workdir: Path) -> Iterator[str]:
    """A real OpenStack Placement service (noauth2, sqlite) on a free port; yields its URL."""
    py = PLACEMENT_VENV / "bin" / "python"
    if not py.exists():
        raise AssertionError(f"no Placement venv at {PLACEMENT_VENV} (make .placement-venv)")
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OS_API__AUTH_STRATEGY="noauth2",
               OS_PLACEMENT_DATABASE__CONNECTION=f"sqlite:///{workdir / 'placement.db'}")
    log = workdir / "placement.log"
    subprocess.run([str(PLACEMENT_VENV / "bin" / "placement-manage"), "db", "sync"], env=env, check=True,
                   capture_output=True, timeout=120)
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(py), "-c", PLACEMENT_SERVE, str(port)], env=env, stdout=out, stderr=out)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url, proc, log, headers={"x-auth-token": "admin"})
        yield url
    finally:
        stop(proc, STOP_TIMEOUT_S)
