"""KSM and zram statistics and the Linux-configuration ownership arithmetic (no VM)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from azqemu.host import memacct

MIB = 1 << 20


def test_ksm_share_and_linux_owned_bytes() -> None:
    ksm = memacct.KsmStat(pages_shared=100, pages_sharing=300)
    assert ksm.share_per_mapping == 0.25
    assert memacct.KsmStat().share_per_mapping == 0.0
    zram = {"orig_data_size": 400 * MIB, "mem_used_total": 100 * MIB}
    assert memacct.zram_bytes_per_stored_byte(zram) == 0.25
    vma = {"Rss": 300 * MIB, "Anonymous": 200 * MIB, "KSM": 40 * MIB, "Swap": 80 * MIB}
    # 160 private + 40 x 0.25 KSM + 80 x 0.25 zram
    assert memacct.linux_owned_bytes(vma, ksm, zram) == (160 + 10 + 20) * MIB
    # Template pages mapped but never copied (Rss - Anonymous) are not owned.
    assert memacct.linux_owned_bytes({"Rss": 500 * MIB}, ksm, zram) == 0
    assert memacct.qemu_own_bytes({"Pss": 700 * MIB}, {"Pss": 500 * MIB}) == 200 * MIB


def test_zram_mm_stat_reader(tmp_path: Path) -> None:
    for dev, vals in (("zram0", "4096 73 12288 0 12288 1 0 0 0"), ("zram1", "8192 100 4096 0 4096 0 0 0 0")):
        (tmp_path / dev).mkdir()
        (tmp_path / dev / "mm_stat").write_text(f"  {vals}\n")
    assert memacct.read_zram_mm_stat("zram0", tmp_path)["mem_used_total"] == 12288
    assert memacct.read_zram_mm_stat("zram9", tmp_path) == {}
    total = memacct.read_zram_total(tmp_path)
    assert total["orig_data_size"] == 12288 and total["mem_used_total"] == 16384 and total["same_pages"] == 1


def test_read_ksm_from_a_directory(tmp_path: Path) -> None:
    for name, v in (("full_scans", 7), ("pages_shared", 10), ("pages_sharing", 30)):
        (tmp_path / name).write_text(f"{v}\n")
    assert memacct.read_ksm(tmp_path) == memacct.KsmStat(full_scans=7, pages_shared=10, pages_sharing=30)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="page frame numbers need root")
def test_exact_owned_bytes_of_a_private_buffer(touched_buffer: tuple[int, int]) -> None:
    start, end = touched_buffer
    owned = memacct.exact_owned_bytes(os.getpid(), start, end, zram={})
    assert owned.private_bytes == 8 * MIB and owned.owned_bytes == 8 * MIB
    assert owned.swap_bytes == 0 and owned.file_bytes == 0
