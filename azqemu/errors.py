"""Errors of azqemu: one root, a tree, and fields instead of bare text.

    AzqemuError                     root; ``str(err)`` is the one line a user sees
    ├── ConfigError                 bad configuration or command-line input
│   ├── MalformedRequest        an API request body that is not JSON
│   ├── RequestInvalid          an API request of the wrong shape (``errors``: where and why)
│   └── PayloadTooLarge         an API request or upload above its limit (``limit_bytes``)
    ├── HostError                   the host cannot do what was asked
    │   ├── LibvirtUnavailable      libvirtd does not answer
    │   ├── DiskFull                no room for the state directory (``path``, ``needed_bytes``)
    │   └── NotRoot                 an operation that needs root
    ├── ImageError                  the guest image is missing or cannot be built
    ├── VirtError                   libvirt refused something (``code`` keeps libvirt's number)
    │   ├── DomainNotFound          (``name``)
    │   └── DomainStateError        (``name``, ``state``, ``required``)
    ├── TemplateError
    │   ├── TemplateNotFound        (``name``)
    │   ├── TemplateExists          (``name``)
    │   └── TemplateInUse           (``name``, ``clones``)
    ├── SandboxError
    │   ├── SandboxNotFound         (``name``)
    │   ├── SandboxExists           (``name``)
    │   ├── GuestFileError          a file in a sandbox cannot be written or read (``name``, ``path``)
    │   │   └── GuestFileNotFound
    │   ├── SandboxStateError       its lifecycle state forbids the operation (``name``, ``state``,
    │   │                           ``operation``, ``reason``; daemon/states.py)
    │   └── GuestWorkloadError      a benchmark's guest program failed (azqemu.bench.restore_bench)
    ├── QMPError                    a QMP command failed (``error_class``)
    ├── AgentError                  the QEMU guest agent failed
    │   ├── AgentTimeout            no answer within ``timeout_s``
    │   └── ExecError               the guest could not start the command (``error_class``)
    ├── StoreError                  the page store
    │   ├── StoreCorrupt            a damaged store or page (``path``, ``detail``)
    │   ├── StoreForeign            not an azqemu store, or another version
    │   ├── StoreFull               no room (ENOSPC/EDQUOT) for ``what`` at ``path``; nothing dropped
    │   └── ChecksumMismatch        a decoded page does not match its checksum (``page_idx``)
    ├── RestoreError                userfaultfd export, handler or prefetch
    ├── PlacementError              OpenStack Placement refused or could not be reached (``status``)
    └── DaemonError                 the manager daemon
        ├── DaemonUnavailable       no daemon on the socket (``socket_path``)
        ├── DaemonBusy              the daemon serves its maximum of requests (``limit``)
        ├── Unauthorized            the API's TCP listener: no or a wrong bearer token
        ├── ApiNotFound             no such API route, method or job (``path``)
        └── RemoteError             an error raised in the daemon that this side cannot rebuild
                                    (``error_type``, ``exit_code``)
"""

from __future__ import annotations


class AzqemuError(Exception):
    """Root of every error azqemu raises on purpose."""

    exit_code = 1


class ConfigError(AzqemuError):
    exit_code = 2


class MalformedRequest(ConfigError):
    pass


class RequestInvalid(ConfigError):
    def __init__(self, message: str, errors: list[dict[str, str]] | None = None) -> None:
        self.errors = errors or []
        super().__init__(message)


class PayloadTooLarge(ConfigError):
    def __init__(self, what: str, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        super().__init__(f"{what} is larger than its limit of {limit_bytes} bytes")


class HostError(AzqemuError):
    pass


class LibvirtUnavailable(HostError):
    def __init__(self, uri: str, detail: str = "") -> None:
        self.uri = uri
        super().__init__(f"libvirtd does not answer at {uri}" + (f": {detail}" if detail else "")
                         + " (start it with 'azq host setup')")


class DiskFull(HostError):
    def __init__(self, path: str, needed_bytes: int, free_bytes: int) -> None:
        self.path, self.needed_bytes, self.free_bytes = path, needed_bytes, free_bytes
        super().__init__(f"not enough space in {path}: need {needed_bytes >> 20} MiB, "
                         f"{free_bytes >> 20} MiB free")


class NotRoot(HostError):
    def __init__(self, what: str) -> None:
        super().__init__(f"{what} needs root")


class ImageError(AzqemuError):
    pass


class VirtError(AzqemuError):
    def __init__(self, message: str, code: int | None = None) -> None:
        self.code = code
        super().__init__(message)


class DomainNotFound(VirtError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no domain named {name!r}")


class DomainStateError(VirtError):
    def __init__(self, name: str, state: str, required: str) -> None:
        self.name, self.state, self.required = name, state, required
        super().__init__(f"domain {name!r} is {state}, needs to be {required}")


class TemplateError(AzqemuError):
    pass


class TemplateNotFound(TemplateError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown template {name!r}")


class TemplateExists(TemplateError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"template {name!r} already exists")


class TemplateInUse(TemplateError):
    def __init__(self, name: str, clones: list[str]) -> None:
        self.name, self.clones = name, clones
        super().__init__(f"template {name!r} still has {len(clones)} clone(s): {', '.join(sorted(clones))}")


class SandboxError(AzqemuError):
    pass


class SandboxNotFound(SandboxError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown sandbox {name!r}")


class SandboxExists(SandboxError):
    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"a domain named {name!r} already exists")


class SandboxStateError(SandboxError):
    """The sandbox is in a lifecycle state (azqemu/daemon/states.py) that forbids ``operation``
    (a failed sandbox carries its ``reason``; only destroy is left to it)."""

    def __init__(self, name: str, state: str, operation: str, reason: str | None = None) -> None:
        self.name, self.state, self.operation, self.reason = name, state, operation, reason
        super().__init__(f"sandbox {name!r} is {state}: cannot {operation}" + (f" ({reason})" if reason else ""))


class GuestFileError(SandboxError):
    def __init__(self, name: str, path: str, detail: str) -> None:
        self.name, self.path, self.detail = name, path, detail
        super().__init__(f"{path} in {name!r}: {detail}")


class GuestFileNotFound(GuestFileError):
    pass


class QMPError(AzqemuError):
    def __init__(self, message: str, error_class: str | None = None) -> None:
        self.error_class = error_class
        super().__init__(message)


class AgentError(AzqemuError):
    pass


class AgentTimeout(AgentError):
    def __init__(self, domain: str, timeout_s: float, what: str = "answer") -> None:
        self.domain, self.timeout_s = domain, timeout_s
        super().__init__(f"guest agent of {domain!r} did not {what} within {timeout_s:g} s")


class ExecError(AgentError):
    def __init__(self, message: str, error_class: str | None = None) -> None:
        self.error_class = error_class
        super().__init__(message)


class StoreError(AzqemuError):
    pass


class StoreCorrupt(StoreError):
    def __init__(self, path: str, detail: str) -> None:
        self.path, self.detail = path, detail
        super().__init__(f"damaged page store {path}: {detail}")


class StoreForeign(StoreError):
    def __init__(self, path: str, detail: str) -> None:
        self.path, self.detail = path, detail
        super().__init__(f"{path} is not an azqemu page store this version can read: {detail}")


class StoreFull(StoreError):
    """The store's file system has no room (ENOSPC/EDQUOT) for ``what``: nothing was dropped,
    the caller keeps its pages. Exit code 75 (EX_TEMPFAIL): space may come back (a destroy,
    a compaction), so trying again later is the user's remedy."""

    exit_code = 75

    def __init__(self, path: str, what: str) -> None:
        self.path, self.what = path, what
        super().__init__(f"page store full at {path}: {what}")


class ChecksumMismatch(StoreError):
    def __init__(self, page_idx: int, detail: str = "") -> None:
        self.page_idx = page_idx
        super().__init__(f"page {page_idx} does not match its checksum" + (f" ({detail})" if detail else ""))


class RestoreError(AzqemuError):
    pass


class PlacementError(AzqemuError):
    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


class DaemonError(AzqemuError):
    pass


class DaemonUnavailable(DaemonError):
    def __init__(self, socket_path: str, detail: str = "") -> None:
        self.socket_path = socket_path
        super().__init__(f"no azqemu daemon at {socket_path}" + (f" ({detail})" if detail else "")
                         + "; start it with 'azq daemon'")


class DaemonBusy(DaemonError):
    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"the daemon serves {limit} requests already; try again")


class Unauthorized(DaemonError):
    pass


class ApiNotFound(DaemonError):
    def __init__(self, message: str, path: str = "") -> None:
        self.path = path
        super().__init__(message)


class RemoteError(DaemonError):
    """An AzqemuError raised inside the daemon, carried back to the CLI with its class name."""

    def __init__(self, error_type: str, message: str, exit_code: int = 1) -> None:
        self.error_type = error_type
        self.exit_code = exit_code
        super().__init__(message)
