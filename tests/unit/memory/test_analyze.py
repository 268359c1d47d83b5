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


def test_metadata_fraction_and_ratio_per_kind(images) -> None:
    t, paths = images
    az = analyze(t, paths)["azqemu"]
    meta = az["blob_metadata_bytes"] + az["index_bytes"]
    assert 0 < az["metadata_fraction"] < 1
    assert az["metadata_fraction"] == pytest.approx(meta / az["bytes_after"], rel=1e-6)
    by_kind = az["by_kind"]
    assert set(by_kind) == {k.name for k in Kind}
    for kind, k in by_kind.items():
        assert k["pages"] == az["pages"][kind] and k["bytes_before"] == k["pages"] * PAGE_SIZE
        assert k["bytes_after"] == az["bytes"][kind]
        assert k["ratio"] == (pytest.approx(k["bytes_before"] / k["bytes_after"]) if k["bytes_after"] else None)
    # Payloads per kind, RAW pages and the metadata make up everything the sandboxes own.
    assert sum(k["bytes_after"] for k in by_kind.values()) + meta == pytest.approx(az["bytes_after"], abs=2)
    assert by_kind["ZERO"]["ratio"] is None and by_kind["TEMPLATE"]["ratio"] is None   # nothing stored
    if by_kind["RAW"]["pages"]:
        assert by_kind["RAW"]["ratio"] == pytest.approx(1.0)
    json.dumps(az, allow_nan=False)


def test_kind_ratios_and_metadata_fraction_arithmetic() -> None:
    from azqemu.memory.analyze import kind_ratios, metadata_fraction
    r = kind_ratios({"ZERO": 3, "ZSTD": 4, "RAW": 1}, {"ZERO": 0, "ZSTD": 4096, "RAW": PAGE_SIZE})
    assert r["ZERO"] == {"pages": 3, "bytes_before": 3 * PAGE_SIZE, "bytes_after": 0, "ratio": None}
    assert r["ZSTD"]["ratio"] == pytest.approx(4.0) and r["RAW"]["ratio"] == pytest.approx(1.0)
    assert metadata_fraction(100, 300, 4000.0) == pytest.approx(0.1)
    assert metadata_fraction(0, 0, 0.0) == 0.0


def test_cli_table_shows_ratio_per_kind_and_metadata(images) -> None:
    from azqemu.cli import cli
    t, paths = images
    res = CliRunner().invoke(cli, ["mem", "analyze", "--template", t, *paths], env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "ratio" in res.output and "metadata" in res.output and "% of after" in res.output
