"""The manager killed (SIGKILL) at a crash point of a compression or a resume, with a real
guest: the next manager serves every page the guest lost, the guest's md5 and its checker
agree, and the next compression works (docs/memory.md, "Crash consistency").

The daemon is restarted with ``AZQ_CRASH_AT`` (azqemu/memory/crashpoint.py) set, asked to
compress, dies at the point, and is started again without it.
"""

from __future__ import annotations

import signal

import pytest

from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
from azqemu.errors import AzqemuError
from azqemu.memory.persist import StoreFull
from tests.support.daemonctl import restart as _restart
from tests.support.daemonctl import start as _start
from tests.support.daemonctl import start_dying
from tests.support.guest import md5_ok, needs_lazy_restore, sh, start_checker, wait_rounds

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]


@pytest.fixture(autouse=True)
def _needs_lazy() -> None:
    needs_lazy_restore()


# Fresh anonymous memory in the guest: the kernel hands out freed pages, which init_on_free
# zeroed; one byte written per page, the rest must still be zero (a page served from the
# template instead of zero shows here).
FRESH_ZERO_CHECK = """
import mmap
n = 160 << 20
m = mmap.mmap(-1, n)
for off in range(0, n, 4096):
    m[off] = 1
print(sum(1 for off in range(0, n, 4096) if m[off + 1:off + 4096].count(0) != 4095))
"""


def _fresh_pages_zero(name: str) -> None:
    code, out = sh(name, f"python3 -c '{FRESH_ZERO_CHECK}'")
    assert (code, out) == (0, "0"), f"fresh guest pages not zero: {code} {out}"



# after-reclaim: the first generation the restarted daemon writes is the compression's commit
# (it starts with nothing to commit: a destroy's tombstone goes with its domain). It was @2
# while earlier tests' tombstones made the restart write one first; alone, the test then failed.
@pytest.mark.parametrize(("ram_mode", "point"), [
    ("lazy", "after-discard-batch@2"), ("lazy", "after-flush"), ("lazy", "after-encode"),
    ("cow", "after-discard-batch"), ("cow", "between-generation-files"), ("cow", "after-drop"),
    ("eager", "after-discard-batch@3"), ("eager", "after-commit"), ("lazy", "after-reclaim")])
def test_manager_killed_during_compress_loses_no_page(template: str, daemon: dict, ram_mode: str,
                                                      point: str) -> None:
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix=f"crash{ram_mode}-", ram_mode=ram_mode)
    name = rec.name
    try:
        code, _ = sh(name, "head -c 20000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        start_checker(name, 24, "c")
        rounds = wait_rounds(name, "c", 0)
        c.compress(name=name)            # a generation before the one that crashes
        md5_ok(name)                            # exec resumes it
        rounds = wait_rounds(name, "c", rounds)

        # Pages the guest wrote and freed again (init_on_free zeroes them): the compression
        # finds them ZERO, and a copy-on-write clone maps them to the zero page after the
        # DISCARD; a manager killed in between must not serve them from the template.
        code, _ = sh(name, "head -c 30000000 /dev/urandom > /tmp/junk; rm /tmp/junk; "
                           "sync; echo 3 > /proc/sys/vm/drop_caches")
        assert code == 0
        _restart(daemon, point)
        with pytest.raises(AzqemuError):
            c.compress(name=name)
        assert daemon["proc"].wait(60) == -signal.SIGKILL

        daemon["proc"] = _start()
        c.resume(name=name, prefetch=False)      # every lost page comes by a fault
        _fresh_pages_zero(name)
        md5_ok(name)
        rounds = wait_rounds(name, "c", rounds, timeout_s=180)
        st = c.compress(name=name)       # the next compression works
        assert st.stored_pages > 0 and not st.cancelled
        md5_ok(name)
        wait_rounds(name, "c", rounds, timeout_s=180)
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        c.destroy(name=name)


@pytest.mark.parametrize("ram_mode", ["lazy", "cow"])
def test_store_full_at_commit_abandons_the_compression(template: str, daemon: dict, ram_mode: str) -> None:
    """The flush that must commit the pages before QEMU drops them fails with StoreFull
    (injected: AZQ_FAIL_AT=flush-before-drop; the real ENOSPC of a flush, reserve retry
    included, is tests/unit/memory/test_store_durability.py's): the compression fails before
    anything is dropped, the guest keeps every page and the next compression works."""
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix=f"full{ram_mode}-", ram_mode=ram_mode)
    name = rec.name
    try:
        code, _ = sh(name, "head -c 20000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        start_checker(name, 24, "f")
        rounds = wait_rounds(name, "f", 0)
        c.compress(name=name)
        md5_ok(name)
        rounds = wait_rounds(name, "f", rounds)
        _restart(daemon, fail_at="flush-before-drop")
        with pytest.raises(StoreFull) as err:
            c.compress(name=name)
        assert err.value.path, err.value
        c.resume(name=name, prefetch=False)
        _fresh_pages_zero(name)
        md5_ok(name)
        rounds = wait_rounds(name, "f", rounds, timeout_s=180)
        st = c.compress(name=name)
        assert st.stored_pages > 0 and not st.cancelled
        md5_ok(name)
        wait_rounds(name, "f", rounds, timeout_s=180)
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        c.destroy(name=name)
        _restart(daemon)            # without AZQ_FAIL_AT for the tests after this one


# -- the resume path ---------------------------------------------------------------------
# (ram mode, point, state the restarted daemon reports before the test resumes it); "exec:":
# the resume of a tool call under agentzip (vCPUs first, the hot set beside the call).
RESUME_POINTS = [
    ("lazy", "after-prefetch", "compressed"), ("cow", "after-prefetch", "compressed"),
    ("eager", "before-prefetch", "compressed"), ("lazy", "after-vcpu-resume", "running"),
    ("cow", "after-reattach", "compressed"), ("lazy", "after-reattach", "compressed"),
    ("eager", "after-pause", "compressed"), ("cow", "exec:after-prefetch", "running")]


@pytest.mark.parametrize(("ram_mode", "point", "state_after"), RESUME_POINTS)
def test_manager_killed_during_resume_loses_no_page(template: str, daemon: dict, ram_mode: str, point: str,
                                                    state_after: str) -> None:
    """Kill -9 the manager on the resume path (after the hot set is back, after the vCPUs
    continue, while a restarted manager reassigns the stored pages to their sources; or after
    the hot set came back beside a tool call) or right after a compression paused the vCPUs:
    the next manager reports the sandbox ``compressed`` (or ``running``), serves every page,
    the guest's md5 and checker agree, and the sandbox compresses and resumes again."""
    via_exec = point.startswith("exec:")
    point = point.removeprefix("exec:")
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix=f"rcrash{ram_mode}-", ram_mode=ram_mode,
                     policy="agentzip" if via_exec else "manual", grace_s=3600.0)
    name = rec.name
    try:
        code, _ = sh(name, "head -c 20000000 /dev/urandom > /tmp/blob; md5sum /tmp/blob > /tmp/blob.md5")
        assert code == 0
        start_checker(name, 24, "r")
        rounds = wait_rounds(name, "r", 0)
        c.compress(name=name)
        md5_ok(name)                            # exec resumes it: the hot set is known
        rounds = wait_rounds(name, "r", rounds)
        if point != "after-pause":
            c.compress(name=name)
            assert c.dominfo(name).state == "compressed"

        if point == "after-reattach":
            # The restarted manager dies while it takes the sandbox's memory back.
            daemonproc.stop(daemon["proc"])
            assert start_dying(point) == -signal.SIGKILL
        else:
            _restart(daemon, point)
            with pytest.raises(AzqemuError):
                if point == "after-pause":
                    c.compress(name=name)
                elif via_exec:
                    c.exec(name=name, argv=["/bin/true"])
                else:
                    c.resume(name=name, prefetch=True)
            assert daemon["proc"].wait(60) == -signal.SIGKILL

        daemon["proc"] = _start()
        info = c.dominfo(name)
        assert (info.state, info.failed_reason) == (state_after, None), info
        if state_after == "compressed":
            assert info.domain_state == "paused"
            md5_ok(name)                        # exec resumes a compressed sandbox itself
        else:
            c.resume(name=name, prefetch=False)
            md5_ok(name)
        _fresh_pages_zero(name)
        rounds = wait_rounds(name, "r", rounds, timeout_s=180)
        st = c.compress(name=name)       # the next compression works
        assert st.stored_pages > 0 and not st.cancelled
        c.resume(name=name, prefetch=True)
        md5_ok(name)
        wait_rounds(name, "r", rounds, timeout_s=180)
        assert c.dominfo(name).state == "running"
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        c.destroy(name=name)
