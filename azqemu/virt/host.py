"""A thin wrapper over a libvirt connection: all libvirt error handling happens here.

``Host`` owns the connection; ``Domain`` wraps one domain with boolean keyword arguments
instead of flag bitmasks. libvirt errors become azqemu errors (``VIR_ERR_NO_DOMAIN`` becomes
``DomainNotFound``, a refused connection ``LibvirtUnavailable``) so nothing above this module
needs to know libvirt's numbers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import libvirt
import libvirt_qemu
from lxml import etree

from azqemu import config as config_mod
from azqemu.errors import (
    AgentError,
    DomainNotFound,
    DomainStateError,
    ExecError,
    LibvirtUnavailable,
    SandboxExists,
    VirtError,
)

log = logging.getLogger(__name__)

# libvirt prints every error to stderr unless a handler takes them; ours go to the log.
libvirt.registerErrorHandler(lambda _ctx, err: log.debug("libvirt: %s", err), None)

AZQ_NS = "http://azqemu.dev/xmlns/sandbox/1"

_STATE_NAMES = {
    libvirt.VIR_DOMAIN_NOSTATE: "nostate", libvirt.VIR_DOMAIN_RUNNING: "running",
    libvirt.VIR_DOMAIN_BLOCKED: "blocked", libvirt.VIR_DOMAIN_PAUSED: "paused",
    libvirt.VIR_DOMAIN_SHUTDOWN: "shutdown", libvirt.VIR_DOMAIN_SHUTOFF: "shutoff",
    libvirt.VIR_DOMAIN_CRASHED: "crashed", libvirt.VIR_DOMAIN_PMSUSPENDED: "pmsuspended",
}


@contextlib.contextmanager
def translate_errors(name: str = "") -> Iterator[None]:
    """Turn libvirt exceptions into azqemu errors, keeping the cause."""
    try:
        yield
    except libvirt.libvirtError as err:
        code = err.get_error_code()
        msg = err.get_error_message() or str(err)
        if code == libvirt.VIR_ERR_NO_DOMAIN:
            raise DomainNotFound(name) from err
        if code in (libvirt.VIR_ERR_OPERATION_INVALID,) and "already exists" in msg:
            raise SandboxExists(name) from err
        if code == libvirt.VIR_ERR_AGENT_UNRESPONSIVE:
            raise AgentError(f"guest agent of {name!r} is not responding") from err
        if "unable to execute QEMU agent command" in msg:
            # The agent answered with an error (e.g. guest-exec of a missing program).
            detail = msg.split("error was ", 1)[-1].strip("'")
            raise ExecError(detail) from err
        if code == libvirt.VIR_ERR_AGENT_UNSYNCED:
            raise AgentError(f"guest agent of {name!r} is not connected yet") from err
        raise VirtError(msg, code) from err


def sandbox_metadata_xml(attrs: dict[str, str], labels: dict[str, str] | None = None) -> str:
    """The ``<sandbox>`` element libvirt's setMetadata takes (it adds our namespace itself)."""
    elem = etree.Element("sandbox", {k: str(v) for k, v in sorted(attrs.items())})
    for key, value in sorted((labels or {}).items()):
        etree.SubElement(elem, "label", key=key, value=value)
    return etree.tostring(elem).decode()


@dataclass(frozen=True)
class DomainInfo:
    name: str
    uuid: str
    state: str
    qemu_pid: int | None
    metadata: dict[str, str]


def qemu_pid_of(name: str) -> int | None:
    """The pid of the running domain ``name``'s QEMU, from libvirt's pid file (None: no such
    domain running)."""
    try:
        with open(f"/run/libvirt/qemu/{name}.pid") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


class Domain:
    """One libvirt domain."""

    def __init__(self, dom: libvirt.virDomain) -> None:
        self._dom = dom
        self.name: str = dom.name()

    @property
    def uuid(self) -> str:
        return self._dom.UUIDString()

    def state(self) -> str:
        with translate_errors(self.name):
            st, _reason = self._dom.state()
        return _STATE_NAMES.get(st, str(st))

    def xml(self) -> str:
        with translate_errors(self.name):
            return self._dom.XMLDesc(0)

    def metadata(self) -> dict[str, str]:
        """The attributes of our <azq:sandbox> metadata element ({} for foreign domains)."""
        root = etree.fromstring(self.xml().encode())
        elem = root.find(f"metadata/{{{AZQ_NS}}}sandbox")
        return dict(elem.attrib) if elem is not None else {}

    def set_metadata(self, attrs: dict[str, str], labels: dict[str, str] | None = None) -> None:
        """Rewrite our ``<azq:sandbox>`` element on the running domain (``virsh dumpxml`` shows
        it at once): ``attrs`` are merged over the attributes it has (role, template ... stay),
        ``labels`` (if given) become its ``<azq:label key= value=>`` children. Live only: our
        domains are transient and have no persistent definition to change."""
        xml = sandbox_metadata_xml({**self.metadata(), **attrs}, labels)
        with translate_errors(self.name):
            self._dom.setMetadata(libvirt.VIR_DOMAIN_METADATA_ELEMENT, xml, "azq", AZQ_NS,
                                  libvirt.VIR_DOMAIN_AFFECT_LIVE)

    def qemu_pid(self) -> int | None:
        """QEMU's pid, from libvirt's pid file (qemu:///system keeps it in /run/libvirt/qemu)."""
        return qemu_pid_of(self.name)

    def info(self) -> DomainInfo:
        return DomainInfo(self.name, self.uuid, self.state(), self.qemu_pid(), self.metadata())

    def suspend(self) -> None:
        with translate_errors(self.name):
            self._dom.suspend()

    def resume(self) -> None:
        with translate_errors(self.name):
            self._dom.resume()

    def destroy(self, *, graceful: bool = False) -> None:
        with translate_errors(self.name):
            if graceful:
                self._dom.destroyFlags(libvirt.VIR_DOMAIN_DESTROY_GRACEFUL)
            else:
                self._dom.destroy()

    def agent_command(self, command_json: str, timeout_s: int) -> str:
        """Send one JSON command to the QEMU guest agent through libvirt's agent channel."""
        try:
            with translate_errors(self.name):
                return libvirt_qemu.qemuAgentCommand(self._dom, command_json, timeout_s, 0)
        except VirtError as exc:
            if exc.code == libvirt.VIR_ERR_OPERATION_INVALID and "not running" in str(exc):
                if not self._active():
                    # Destroyed meanwhile: no agent will ever answer, the caller stops now.
                    raise DomainStateError(self.name, "shut off", "running") from exc
                # Paused (a compression in progress): libvirt refused before sending anything,
                # so the caller may wait for the agent and ask again.
                raise AgentError(f"guest agent of {self.name!r} unavailable: the domain is paused") from exc
            raise

    def _active(self) -> bool:
        try:
            return bool(self._dom.isActive())
        except libvirt.libvirtError:
            return False


class Host:
    """Owns the libvirt connection. Thread-safe: libvirt connections may be shared by threads."""

    def __init__(self, uri: str | None = None) -> None:
        self.uri = uri or config_mod.load().libvirt_uri
        try:
            self._conn = libvirt.open(self.uri)
        except libvirt.libvirtError as err:
            raise LibvirtUnavailable(self.uri, err.get_error_message() or "") from err
        self._lock = threading.Lock()

    def close(self) -> None:
        with contextlib.suppress(libvirt.libvirtError):
            self._conn.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def version(self) -> str:
        """libvirt's library version as 'major.minor.micro'."""
        with translate_errors():
            v = self.conn.getLibVersion()
        return f"{v // 1000000}.{v // 1000 % 1000}.{v % 1000}"

    @classmethod
    def wait(cls, uri: str, timeout_s: float) -> Host:
        """Connect, retrying until libvirtd answers (it was just started) or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(uri)
            except LibvirtUnavailable:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)

    def alive(self) -> bool:
        try:
            return bool(self._conn.isAlive())
        except libvirt.libvirtError:
            return False

    @property
    def conn(self) -> libvirt.virConnect:
        """The connection, reopened if libvirtd restarted (running domains survive that)."""
        with self._lock:
            if not self.alive():
                log.warning("libvirt connection lost; reconnecting to %s", self.uri)
                try:
                    self._conn = libvirt.open(self.uri)
                except libvirt.libvirtError as err:
                    raise LibvirtUnavailable(self.uri, err.get_error_message() or "") from err
            return self._conn

    @staticmethod
    def qemu_pid(name: str) -> int | None:
        """The pid of domain ``name``'s QEMU, or None (not running), without the libvirtd
        round trip of ``get_domain(name).qemu_pid()``: samplers ask it of every sandbox each
        second."""
        return qemu_pid_of(name)

    def get_domain(self, name: str) -> Domain:
        with translate_errors(name):
            return Domain(self.conn.lookupByName(name))

    def has_domain(self, name: str) -> bool:
        try:
            self.get_domain(name)
            return True
        except DomainNotFound:
            return False

    def create_transient(self, xml: str, name: str, *, paused: bool) -> Domain:
        """Start a transient domain (it vanishes from libvirt when it stops)."""
        flags = libvirt.VIR_DOMAIN_START_PAUSED if paused else 0
        if self.has_domain(name):
            raise SandboxExists(name)
        with translate_errors(name):
            return Domain(self.conn.createXML(xml, flags))

    def domains(self) -> list[Domain]:
        """Every active domain that carries azqemu metadata."""
        with translate_errors():
            doms = self.conn.listAllDomains(libvirt.VIR_CONNECT_LIST_DOMAINS_ACTIVE)
        out = []
        for dom in doms:
            d = Domain(dom)
            try:
                if d.metadata():
                    out.append(d)
            except (DomainNotFound, VirtError):
                continue  # went away while listing
        return out
