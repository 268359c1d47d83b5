"""The sandbox lifecycle as an explicit state machine, with a lock beside each sandbox's state.

A sandbox is always in one of these states (cloud-hypervisor's ``VmState`` and qemu.qmp's
``Runstate`` are the models):

    creating ──> running ──> compressing ──> compressed ──> resuming ──> running
                   │  ^            │    ^       │     │         │
                   │  └────────────┘    └───────┘     │         └──> compressed (resume refused)
                   │   (cancelled, refused)  (again)  │
                   └──> destroying <──────────────────┘      any state ──> failed ──> destroying

``TRANSITIONS`` is the whole table and ``valid_transition`` the one place it is checked.
``failed`` carries a reason (an unservable page, a dead fault handler, lost stored pages, a
destroy that failed) and is sticky: an operation that was under way when its sandbox failed
cannot move it anywhere but ``destroying``. ``destroying`` ends the sandbox (its ``Slot`` is
retired) or, if the destroy itself fails, ``failed``.

Every operation that changes a sandbox holds its ``Slot.lock`` (an RLock, for the whole
operation) and moves it with ``Slot.to``. ``Slot.fail`` is the one exception: a fault
handler's supervisor fails a sandbox from its own thread without that lock, because the
lock may be held by an operation that waits on the very fault that cannot be served (a
libvirt call blocks while QEMU's main thread waits on a page). The fields are guarded by a
small mutex that is never held while anything waits.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable

from azqemu.errors import SandboxNotFound, SandboxStateError

# A reason is one line for ``azq list``; longer ones (a traceback's text) are cut here.
MAX_REASON_CHARS = 500


class State(str, enum.Enum):
    CREATING = "creating"
    RUNNING = "running"
    COMPRESSING = "compressing"
    COMPRESSED = "compressed"
    RESUMING = "resuming"
    FAILED = "failed"
    DESTROYING = "destroying"

    def __str__(self) -> str:
        return self.value


S = State
TRANSITIONS: dict[State, frozenset[State]] = {
    S.CREATING: frozenset({S.RUNNING, S.FAILED, S.DESTROYING}),
    S.RUNNING: frozenset({S.COMPRESSING, S.DESTROYING, S.FAILED}),
    # A compression ends compressed, or running again when it was cancelled or refused before
    # anything was dropped (from compressed: compressed again).
    S.COMPRESSING: frozenset({S.COMPRESSED, S.RUNNING, S.FAILED}),
    S.COMPRESSED: frozenset({S.COMPRESSING, S.RESUMING, S.DESTROYING, S.FAILED}),
    # A resume whose vCPUs could not be continued leaves the sandbox compressed (paused).
    S.RESUMING: frozenset({S.RUNNING, S.COMPRESSED, S.FAILED}),
    S.FAILED: frozenset({S.DESTROYING}),
    S.DESTROYING: frozenset({S.FAILED}),
}
# States in which the sandbox's vCPUs are stopped by azqemu (a tool call resumes them).
PAUSED_BY_AZQ = frozenset({S.COMPRESSING, S.COMPRESSED, S.RESUMING})
# States an operation in progress holds the lock through; a sandbox found in one of them
# when no operation runs was left there by a manager that died (reconcile settles it).
TRANSIENT = frozenset({S.CREATING, S.COMPRESSING, S.RESUMING, S.DESTROYING})


def valid_transition(old: State, new: State) -> bool:
    """Whether a sandbox may go from ``old`` to ``new`` (the one check of the table)."""
    return new in TRANSITIONS[old]


def parse_state(value: object, default: State = S.RUNNING) -> State:
    """A state read back from a record (an unknown or missing value gives ``default``)."""
    try:
        return State(str(value))
    except ValueError:
        return default


# Called with (name, state, reason) after every change, under the slot's mutex: the
# registry writes the state into the sandbox's record.
OnChange = Callable[[str, State, "str | None"], None]
# Called with (name, the state it was in, reason) when a sandbox becomes failed, also under
# the mutex (whichever thread failed it): the manager's event log (never blocks).
OnFailed = Callable[[str, State, str], None]


class Slot:
    """One sandbox's lifecycle state, its reason, and the lock its operations hold."""

    def __init__(self, name: str, state: State = S.CREATING, reason: str | None = None, *,
                 on_change: OnChange | None = None, on_failed: OnFailed | None = None) -> None:
        self.name = name
        self.lock = threading.RLock()
        self._mu = threading.Lock()
        self._state = state
        self._reason = reason if state is S.FAILED else None
        self._on_change = on_change
        self._on_failed = on_failed
        self._execs = 0              # guest-agent commands under way (outside the lock)
        self._destroy_requested = False
        self._retired = False
        self.user_paused = False     # the user's own pause: azqemu does not resume it

    # -- reading ----------------------------------------------------------------------------
    @property
    def state(self) -> State:
        return self._state

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def retired(self) -> bool:
        """The sandbox was destroyed: an operation that waited for the lock finds it gone."""
        return self._retired

    @property
    def destroy_requested(self) -> bool:
        return self._destroy_requested

    @property
    def execs(self) -> int:
        return self._execs

    def snapshot(self) -> tuple[State, str | None]:
        with self._mu:
            return self._state, self._reason

    # -- changing -------------------------------------------------------------------------
    def to(self, new: State, reason: str | None = None) -> None:
        """Move to ``new`` (the caller holds ``lock``). Raises SandboxStateError when the
        table does not allow it; a failed sandbox stays failed whatever was under way."""
        with self._mu:
            old = self._state
            if not valid_transition(old, new):
                raise SandboxStateError(self.name, old.value, f"become {new.value}",
                                        self._reason if old is S.FAILED else None)
            self._set(new, reason)

    def fail(self, reason: str) -> bool:
        """Fail the sandbox from any thread, without its lock; False if it was failed or is
        being destroyed already (the first reason is kept)."""
        with self._mu:
            if self._state in (S.FAILED, S.DESTROYING) or self._retired:
                return False
            self._set(S.FAILED, reason)
            return True

    def _set(self, new: State, reason: str | None) -> None:
        old = self._state
        self._state = new
        self._reason = (reason or "unknown cause")[:MAX_REASON_CHARS] if new is S.FAILED else None
        if self._on_change is not None:
            self._on_change(self.name, new, self._reason)
        if new is S.FAILED and old is not S.FAILED and self._on_failed is not None:
            self._on_failed(self.name, old, self._reason or "")

    def require(self, operation: str, allowed: Iterable[State]) -> State:
        """The current state if it is one of ``allowed``; SandboxStateError otherwise."""
        state, reason = self.snapshot()
        if self._retired:
            raise SandboxNotFound(self.name)
        if state not in allowed:
            raise SandboxStateError(self.name, state.value, operation, reason)
        return state

    def request_destroy(self) -> None:
        """A destroy waits for the lock: operations that have not started yet refuse."""
        with self._mu:
            self._destroy_requested = True

    def retire(self) -> None:
        with self._mu:
            self._retired = True

    def exec_started(self) -> None:
        with self._mu:
            self._execs += 1

    def exec_ended(self) -> None:
        with self._mu:
            self._execs = max(0, self._execs - 1)


class SlotTable:
    """The slots of every sandbox the daemon knows, by name (thread-safe)."""

    def __init__(self, on_change: OnChange | None = None) -> None:
        self._slots: dict[str, Slot] = {}
        self._guard = threading.Lock()
        self._on_change = on_change
        # Told when any slot becomes failed (set by the manager: its event log).
        self.on_failed: OnFailed | None = None

    def _failed(self, name: str, old: State, reason: str) -> None:
        if self.on_failed is not None:
            self.on_failed(name, old, reason)

    def get(self, name: str) -> Slot | None:
        with self._guard:
            return self._slots.get(name)

    def get_or_add(self, name: str, state: Callable[[], tuple[State, str | None]]) -> Slot:
        """The slot of ``name``; a new one in ``state()`` if there is none."""
        with self._guard:
            slot = self._slots.get(name)
            if slot is None:
                st, reason = state()
                slot = self._slots[name] = Slot(name, st, reason, on_change=self._on_change,
                                                on_failed=self._failed)
            return slot

    def add(self, name: str, state: State = S.CREATING, reason: str | None = None, *,
            replace: bool = False) -> Slot:
        """A new slot for ``name``, replacing a retired one (any one with ``replace``);
        SandboxStateError if a live one exists (two clones of one name at once)."""
        with self._guard:
            old = self._slots.get(name)
            if old is not None and not old.retired and not replace:
                raise SandboxStateError(name, old.state.value, "be created again")
            slot = self._slots[name] = Slot(name, state, reason, on_change=self._on_change,
                                            on_failed=self._failed)
        if old is not None and old is not slot:
            old.retire()
        return slot

    def remove(self, name: str, slot: Slot | None = None) -> None:
        """Retire and forget the slot of ``name`` (only ``slot`` if given)."""
        with self._guard:
            cur = self._slots.get(name)
            if cur is None or (slot is not None and cur is not slot):
                return
            del self._slots[name]
        cur.retire()

    def items(self) -> list[tuple[str, Slot]]:
        with self._guard:
            return list(self._slots.items())
