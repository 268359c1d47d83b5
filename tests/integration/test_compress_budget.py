"""A compression that runs out of its wait's CPU budget (``AZQ_COMPRESS_CPU_BUDGET_S``,
daemon/cpubudget.py) commits what it encoded and leaves the copies it did not reach resident,
exactly as they were: the guest's md5 and its memory checker hold across the cycles, and a
compression with the default budget then reaches every page."""

from __future__ import annotations

import pytest

from azqemu.client import Client
from azqemu.daemon import proc as daemonproc
from tests.support.daemonctl import restart as _restart
from tests.support.daemonctl import start as _start
from tests.support.guest import blob_and_checker, md5_ok, needs_lazy_restore, wait_rounds

pytestmark = [pytest.mark.vm, pytest.mark.root, pytest.mark.uffd]


@pytest.mark.parametrize("ram_mode", ["cow", "lazy"])
def test_a_compression_past_its_budget_leaves_the_rest_resident(template: str, daemon: dict, ram_mode: str) -> None:
    needs_lazy_restore()
    c = Client()
    (rec,) = c.clone(template=template, count=1, name_prefix=f"budget{ram_mode}-", ram_mode=ram_mode)
    name = rec.name
    try:
        # Compressible pages of the guest's own (text), beside a checker's heap.
        rounds = blob_and_checker(name, 24, "b")
        # A budget spent by the first chunk: every compression stops after it.
        _restart(daemon, env={"AZQ_COMPRESS_CPU_BUDGET_S": "0.000001"})
        for _cycle in range(2):
            st = c.compress(name=name)
            assert st.budget_stopped and st.left_pages > 0 and not st.cancelled, st
            assert st.stored_pages + st.raw_pages <= st.resident_pages - st.left_pages
            c.resume(name=name, prefetch=False)
            md5_ok(name)
            rounds = wait_rounds(name, "b", rounds, timeout_s=180)
        _restart(daemon)
        st = c.compress(name=name)
        assert not st.budget_stopped and st.left_pages == 0 and st.stored_pages > 0, st
        # Where its CPU went: the thread's CPU seconds and the codec attempts (new text: zstd).
        assert st.cpu_s > 0 and st.tries.get("zstd", 0) > 0 and st.unchanged_pages >= 0, st
        md5_ok(name)
        wait_rounds(name, "b", rounds, timeout_s=180)
    finally:
        if not daemonproc.running():
            daemon["proc"] = _start()
        c.destroy(name=name)
        _restart(daemon)            # the default budget for the tests after this one
