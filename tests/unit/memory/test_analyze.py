"""`azq mem analyze` and the Linux model: the JSON contract and the figures' arithmetic."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from azqemu.errors import ConfigError
from azqemu.memory.analyze import analyze
from azqemu.memory.kinds import PAGE_SIZE, Kind
from azqemu.memory.linux_model import linux_model
from azqemu.memory.ram import write_sparse_image

from .conftest import make_template, random_page, text_page


@pytest.fixture
def images(store_dir, small_set):
    t = store_dir / "template.ram"
    write_sparse_image(t, small_set.template_idx, small_set.template_pages, small_set.size_bytes)
    paths = []
    for k, (idx, pages) in enumerate(small_set.sandboxes):
        p = store_dir / f"sb{k}.ram"
        write_sparse_image(p, idx, pages, small_set.size_bytes)
        paths.append(str(p))
    return str(t), paths


def test_analyze_contract(images) -> None:
    t, paths = images
    r = analyze(t, paths)
    az = r["azqemu"]
    assert set(az) >= {"ratio", "bytes_before", "bytes_after", "pages", "bytes"}
    assert set(az["pages"]) == {k.name for k in Kind} == set(az["bytes"])
    assert r["linux_model"]["compressor"] in ("lzo-rle", "lz4")
    assert set(r["linux_model"]) >= {"ratio", "compressor"}
    assert set(r["throughput"]) >= {"encode_mib_s", "decode_mib_s"}
    assert az["bytes_before"] == sum(az["pages"].values()) * PAGE_SIZE
    assert az["ratio"] == pytest.approx(az["bytes_before"] / az["bytes_after"], rel=1e-6)
    assert az["ratio"] > r["linux_model"]["ratio"] > 1
    assert az["bytes"]["RAW"] == az["pages"]["RAW"] * PAGE_SIZE
    json.dumps(r)


def test_analyze_with_a_resolver(images) -> None:
    t, paths = images
    names = {f"sandbox-{k}": p for k, p in enumerate(paths)}
    r = analyze(t, list(names), resolver=names.__getitem__)
    assert set(r["azqemu"]["sandboxes"]) == set(names)


def test_analyze_bad_input(images) -> None:
    t, paths = images
    with pytest.raises(ConfigError):
        analyze(t, [])
    with pytest.raises(ConfigError):
        analyze(t, ["/nonexistent/ram"])


def test_cli_json_and_table(images) -> None:
    from azqemu.cli import cli
    t, paths = images
    runner = CliRunner()
    res = runner.invoke(cli, ["mem", "analyze", "--template", t, *paths, "--json", "--sharing-domain", "tenant1"])
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    assert r["azqemu"]["ratio"] > 1 and r["linux_model"]["compressor"] == "lz4"
    res = runner.invoke(cli, ["mem", "analyze", "--template", t, paths[0]])
    assert res.exit_code == 0, res.output
    assert "azqemu" in res.output and "Linux model" in res.output


def test_linux_model_arithmetic() -> None:
    tpl = [text_page(i) for i in range(4)]
    template = make_template(tpl, n_pages=32)
    shared = text_page(100)
    a = np.stack([tpl[0], tpl[1], np.zeros(PAGE_SIZE, np.uint8), shared, random_page(5)])
    b = np.stack([tpl[2], shared, text_page(101)])
    r = linux_model(template, [(np.arange(5), a), (np.arange(3), b)])
    assert r.bytes_before == 8 * PAGE_SIZE
    assert r.pages["zero"] == 1 and r.pages["merged_with_template"] == 3
    assert r.pages["merged_with_sibling"] == 1 and r.pages["huge"] == 1   # the random page
    import lz4.block
    size = lambda p: len(lz4.block.compress(p.tobytes(), store_size=False))   # noqa: E731
    expect = size(shared) + PAGE_SIZE + size(text_page(101))
    assert r.bytes_after == pytest.approx(expect)
    assert r.per_sandbox_after[0] == pytest.approx(size(shared) / 2 + PAGE_SIZE)
    assert r.compressor == "lz4"
