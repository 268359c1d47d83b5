"""Quantiles without numpy's percentile (which loads numpy.ma into the manager for good)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from azqemu.quantiles import quantiles
from tests.support.synthetic import Corpus, make_set

PERCENTS = (0, 1, 25, 50, 90, 99, 99.9, 100)


@given(arrays(np.float64, st.integers(1, 300), elements=st.floats(-1e9, 1e9)))
def test_quantiles_are_numpys_linear_ones(values: np.ndarray) -> None:
    assert quantiles(values, PERCENTS) == pytest.approx(np.percentile(values, PERCENTS).tolist(), rel=1e-9, abs=1e-6)


def test_integer_samples_and_bad_input() -> None:
    assert quantiles(np.array([3, 1, 2, 4], dtype=np.uint64), (50, 100)) == [2.5, 4.0]
    assert quantiles(np.array([7]), (0, 50, 100)) == [7.0, 7.0, 7.0]
    with pytest.raises(ValueError, match="empty"):
        quantiles(np.empty(0), (50,))
    with pytest.raises(ValueError, match="0-100"):
        quantiles(np.arange(3), (101,))


def test_the_daemon_does_not_load_numpy_ma_or_random(tmp_path: Path) -> None:
    """The daemon's modules, the fault figures it computes and a store's encode, flush,
    discard, decode and free leave numpy.ma unloaded (numpy 2.4's plain np.unique asks numpy.ma
    whether its input is masked: pages.unique_idx stands in for it), and numpy.random too
    (1.7 MiB held for good, once drawn from). The pages are made
    here (the synthetic set's helpers use np.setdiff1d) and read there from a file."""
    s = make_set(Corpus.load(2 << 20, seed=3), template_pages=512, sandboxes=3, resident_pages=300, seed=11)
    data = tmp_path / "set.npz"
    np.savez(data, template_idx=s.template_idx, template_pages=s.template_pages, size=s.size_bytes,
             **{f"idx{k}": idx for k, (idx, _) in enumerate(s.sandboxes)},
             **{f"pages{k}": pages for k, (_, pages) in enumerate(s.sandboxes)})
    code = f"""
import sys, numpy as np
import azqemu.daemon.server, azqemu.daemon.memstats, azqemu.restore.handler
from azqemu.quantiles import quantiles
from tests.support.synthetic import Corpus, make_set
from azqemu.memory.store import PageStore
from azqemu.memory.template import TemplateImage
quantiles(np.arange(100, dtype=np.uint64), (50, 90, 99))
d = np.load({str(data)!r})
tpl = TemplateImage(page_idx=d["template_idx"], pages=d["template_pages"], size_bytes=int(d["size"]))
with PageStore({str(tmp_path / "store")!r}, arena_bytes=1 << 20) as store:
    for k in range({len(s.sandboxes)}):
        store.encode(f"s{{k}}", "d", d[f"idx{{k}}"], d[f"pages{{k}}"], tpl)
    store.flush()
    assert (store.decode("s1", d["idx1"]) == d["pages1"]).all()
    store.discard("s0", d["idx0"][:50])
    store.flush()
    for k in range({len(s.sandboxes)}):
        store.free_sandbox(f"s{{k}}")
    store.flush()
print("numpy.ma" in sys.modules, "numpy.random" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False False"
