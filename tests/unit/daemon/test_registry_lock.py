"""Registry.lock: a waiter whose slot is retired meanwhile takes the name's current slot."""

from __future__ import annotations

import threading
import time

from azqemu.daemon.registry import Registry
from azqemu.daemon.states import State


def test_a_waiter_on_a_retired_slot_takes_the_current_one(registry: Registry) -> None:
    old = registry.slots.add("x-0", State.RUNNING)
    inside = threading.Event()
    held: list[bool] = []

    def waiter() -> None:
        with registry.lock("x-0"):
            inside.set()
            new = registry.slots.get("x-0")
            assert new is not None
            # Whoever holds the name's current lock excludes every other holder of it.
            held.append(new.lock._is_owned())   # type: ignore[attr-defined]

    with old.lock:
        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.1)
        assert not inside.is_set()            # it waits on the old slot
        # The sandbox goes and a clone takes its name again, all under the old lock.
        registry.slots.add("x-0", State.CREATING, replace=True)
        assert old.retired
    t.join(5)
    assert inside.is_set() and held == [True]


def test_a_name_with_nothing_holds_nothing(registry: Registry) -> None:
    with registry.lock("nobody"):
        pass
    assert registry.slots.get("nobody") is None


def test_the_lock_is_reentrant_for_its_holder(registry: Registry) -> None:
    registry.slots.add("x-1", State.RUNNING)
    with registry.lock("x-1"), registry.lock("x-1"):
        pass
