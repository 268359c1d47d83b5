"""The API's request and response models (pydantic v2), shared by the daemon and the client.

Requests are strict: a field of the wrong JSON type, an unknown field, NaN or infinity is a
``RequestInvalid`` (422) before anything runs; the values themselves (names, ranges) are then
checked by ``azqemu.daemon.requests``, the same checks for every route (``ConfigError``, 400).
Responses name the fields every client may rely on and keep any others the daemon adds
(``extra="allow"``): a new field in ``azq list`` reaches ``--json`` without a change here.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The grace is the scheduler's own default (sched/policy.py says why), re-exported for clients.
from azqemu.sched.policy import DEFAULT_GRACE_S as DEFAULT_GRACE_S

# The values of ``requests`` are the daemon's: these defaults mirror the manager's ``op_*``.
DEFAULT_EXEC_TIMEOUT_S = 300.0


class Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class Response(BaseModel):
    model_config = ConfigDict(extra="allow")

    def as_json(self) -> dict[str, Any]:
        """Every field, the extra ones included, as JSON values (``--json`` output)."""
        return self.model_dump(mode="json")


# -- requests --------------------------------------------------------------------------
class TemplateCreate(Request):
    name: str = Field(description="Template name: 1-64 of A-Z a-z 0-9 . _ - (not starting with . or -)")
    mem_mib: int = Field(512, description="Guest memory in MiB (64 or more)")
    vcpus: int = 1
    warmup: list[str] = Field(default_factory=list, description="Shell commands run in the guest before saving")


class CloneRequest(Request):
    template: str
    count: int = Field(1, description="How many clones (ignored when names are given)")
    name_prefix: str | None = Field(None, description="Clone names are PREFIX0, PREFIX1, ... (default TEMPLATE-)")
    sharing_domain: str = "default"
    names: list[str] | None = None
    ram_mode: Literal["eager", "lazy", "cow"] | None = None
    policy: str = "manual"
    grace_s: float = DEFAULT_GRACE_S
    labels: dict[str, str] = Field(default_factory=dict, description="The orchestrator's key/value pairs")
    ttl_s: float | None = Field(None, description="Destroy each clone this many seconds from now")


class SandboxUpdate(Request):
    labels: dict[str, str] | None = Field(None, description="Labels to set (merged; an empty value removes one)")
    replace_labels: bool = Field(False, description="Replace every label instead of merging")
    ttl_s: float | None = Field(None, description="A new time to live, from now")


class ExecRequest(Request):
    argv: list[str] = Field(description="The command and its arguments (no shell unless you run one)")
    timeout_s: float = DEFAULT_EXEC_TIMEOUT_S
    stdin_b64: str | None = Field(None, description="Standard input, base64")
    kind: str | None = Field(None, description="The tool's name: a resume brings back the pages the last call of "
                             "this kind used (default: calls are told apart by their command's words)")


class PhaseRequest(Request):
    phase: str = Field(description="'wait' (the agent waits for its LLM) or 'tool' (a tool call comes)")


class ResumeRequest(Request):
    prefetch: bool = Field(True, description="Put the hot set back before the vCPUs continue")


class PolicyRequest(Request):
    names: list[str]
    policy: str
    grace_s: float | None = None
    pressure_budget_bytes: int | None = None


# -- responses -------------------------------------------------------------------------
class Ping(Response):
    pid: int
    started_at: float
    sandboxes: int
    version: str = ""
    api: str = ""


class Template(Response):
    name: str
    mem_mib: int
    vcpus: int
    accel: str = ""
    warmup: list[str] = Field(default_factory=list)
    devstate_bytes: int = 0
    ram_data_bytes: int = 0
    boot_s: float = 0.0
    create_s: float = 0.0
    created_at: float = 0.0
    clones: int | None = Field(None, description="Sandboxes cloned from it (listings only)")


class Sandbox(Response):
    """A sandbox's record (what a clone returns)."""

    name: str
    template: str
    sharing_domain: str
    ram_mode: str
    uuid: str
    created_at: float
    clone_s: float = 0.0
    policy: str = "manual"
    grace_s: float = DEFAULT_GRACE_S


class SandboxInfo(Sandbox):
    """One row of ``azq list``: the record, the domain's state and the memory it holds."""

    state: str
    qemu_pid: int | None = None
    resident_bytes: int | None = None
    stored_bytes: int | None = 0
    compressed: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    expires_at: float | None = Field(None, description="Unix time its time to live ends (destroyed then)")


class DomInfo(SandboxInfo):
    """``SandboxInfo`` and the template's machine, the manager's memory (extra fields)."""


class ExecResult(Response):
    exit_code: int
    stdout_b64: str
    stderr_b64: str
    duration_s: float
    resume_s: float = 0.0
    prefetched_pages: int = 0
    lock_wait_s: float = Field(0.0, description="Waiting for an operation on the sandbox (a compression) to stop")
    faults: int = Field(0, description="Page faults the manager served while the command ran")
    faults_from_store: int = Field(0, description="Of those, pages the store served (not first touches of the "
                                   "template or of a hole): what a trim or the resume's hot set missed")
    trim_paused_s: float = Field(0.0, description="Time the vCPUs were paused by trims while the command ran")

    @property
    def stdout(self) -> bytes:
        return base64.b64decode(self.stdout_b64)

    @property
    def stderr(self) -> bytes:
        return base64.b64decode(self.stderr_b64)


class FileWritten(Response):
    name: str
    path: str
    size_bytes: int


class ResumeResult(Response):
    resume_s: float
    prefetched_pages: int = 0
    prefetch_s: float = 0.0


class PhaseResult(Response):
    name: str
    phase: str
    resume_s: float | None = Field(None, description="Set when a 'tool' hint resumed a compressed sandbox")


class CompressResult(Response):
    name: str
    resident_pages: int
    stored_pages: int
    raw_pages: int
    pages: dict[str, int]
    bytes: dict[str, int]
    total_s: float
    cancelled: bool
    stored_bytes: int
    resident_bytes: int | None = None
    # The wait's CPU budget ran out (AZQ_COMPRESS_CPU_BUDGET_S): ``left_pages`` copies were not
    # reached and stay resident for the next compression.
    budget_stopped: bool = False
    left_pages: int = 0
    # Copies still equal to their stored entries: not encoded again.
    unchanged_pages: int = 0
    # Incompressible pages (in ``raw_pages``) unchanged since the last compression: not tried again.
    raw_untried_pages: int = 0
    encode_s: float = 0.0
    # CPU seconds of the compressing thread, and its codec attempts per codec (zstd, xor,
    # prefix, sdelta, lz4, patch): where a wait's compression CPU went.
    cpu_s: float = 0.0
    tries: dict[str, int] = {}


class TrimResult(Response):
    cold_after_s: float = 0.0
    resident_pages: int = 0
    dropped_pages: int = 0
    zero_pages: int = Field(0, description="Of the dropped pages, zero ones (freed by the guest): mapped to the zero page")
    encoded_pages: int = 0
    stored_pages: int = 0
    changed_pages: int = Field(0, description="Pages to drop that the guest wrote while the trim ran beside it: kept")
    encode_s: float = 0.0
    paused_s: float = Field(0.0, description="Time the vCPUs were paused (the check and the drop)")
    verify_s: float = Field(0.0, description="Of paused_s: reading again and hashing the copies to drop")
    drop_s: float = Field(0.0, description="Of paused_s: discarding them inside QEMU")
    map_s: float = Field(0.0, description="Of paused_s: mapping the zero and template pages in their place")
    total_s: float = 0.0


class OwnedRow(Response):
    """A sandbox's figures, or (only) ``name`` and ``error``: why they could not be read."""

    name: str
    owned_bytes: int = 0
    resident_bytes: int = 0
    stored_bytes: int = 0
    qemu_own_bytes: int = 0


class Owned(Response):
    sandboxes: dict[str, OwnedRow]
    store_bytes: int
    store_live_bytes: int
    manager_rss_bytes: int
    manager_memory: dict[str, Any] = Field(default_factory=dict)


class DomStats(Response):
    """One sandbox's figures (``azq domstats``, in the manner of ``virsh domstats``)."""

    name: str
    state: str = Field(description="Lifecycle state: running, compressed, failed ...")
    failed_reason: str | None = None
    domain_state: str = Field(description="The domain's state as libvirt says it (gone: no domain)")
    policy: str
    ram_mode: str
    phase: str | None = Field(None, description="tool, wait or unknown (None: not scheduled)")
    compressed: bool
    owned_bytes: int
    resident_bytes: int
    stored_bytes: int
    qemu_own_bytes: int
    faults: int = Field(description="Page faults the manager's handler read (cumulative)")
    faults_served: int
    fault_errors: int = Field(description="Faults left waiting because no content existed")
    compress_count: int = Field(description="Compressions that finished since the daemon started")
    restore_count: int = Field(description="Resumes of a compressed sandbox since the daemon started")
    compress_s_total: float
    restore_s_total: float


class MemStats(Response):
    """Restore figures of one sandbox (``azq bench restore``); fields as the memory service gives them."""

    name: str
    compressed: bool


class Event(Response):
    """One event of a sandbox (daemon/eventlog.py). ``source`` tells libvirt's lifecycle events
    (started, suspended, resumed, stopped, ...) from azqemu's own (created, phase, compress,
    resume, failed, destroyed, released); a kind's fields are present when it has them."""

    time: float = Field(description="Unix time")
    sandbox: str
    event: str = Field(description="The kind: libvirt's lifecycle event, or created, phase, compress, "
                                   "resume, failed, destroyed, released")
    detail: str = Field(description="One short line: libvirt's detail, or done / cancelled / failed, ...")
    source: str = Field("libvirt", description="libvirt or azqemu")
    seq: int | None = Field(None, description="Order within this daemon's life (times may tie)")
    phase: str | None = Field(None, description="phase: tool or wait")
    signal: str | None = Field(None, description="phase: what decided it (hint, exec, agent, host)")
    duration_s: float | None = Field(None, description="created, compress, resume, destroyed: how long it took")
    stored_bytes: int | None = Field(None, description="compress: the sandbox's bytes in the page store")
    stored_pages: int | None = None
    resident_pages: int | None = Field(None, description="compress: the pages it held when it began")
    prefetched_pages: int | None = None
    prefetched_bytes: int | None = Field(None, description="resume: the hot set copied back before the vCPUs")
    left_pages: int | None = Field(None, description="resume: pages predicted but left to first touch (the "
                                                     "call's kind runs long)")
    present_pages: int | None = Field(None, description="resume beside a call: predicted pages the guest "
                                                        "touched before the prefetch reached them (faulted)")
    reason: str | None = Field(None, description="failed, and a compress or resume that failed: why")
    state: str | None = Field(None, description="failed, destroyed: the state it was in")
    template: str | None = Field(None, description="created: of which template")
    ram_mode: str | None = Field(None, description="created: eager, lazy or cow")

    def as_json(self) -> dict[str, Any]:
        """The fields the event has (a kind's absent fields are left out, not null)."""
        return self.model_dump(mode="json", exclude_none=True)


class ErrorInfo(BaseModel):
    type: str = Field(description="The error's class name (azqemu.errors and the modules named by module)")
    message: str
    exit_code: int = Field(description="What azq exits with for this error")
    fields: dict[str, Any] = Field(default_factory=dict, description="The error's own fields (name, path, ...)")
    module: str = Field("azqemu.errors", description="Where the class is defined")


class ErrorBody(BaseModel):
    error: ErrorInfo


class Job(Response):
    id: str
    kind: str
    state: Literal["running", "succeeded", "failed"]
    created_at: float
    finished_at: float | None = None
    result: Any = None
    error: ErrorInfo | None = None
