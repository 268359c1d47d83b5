"""A block's hot marks: a bit per page, two maps alternated per phase, never reallocated."""

from __future__ import annotations

from azqemu.restore.hotmap import HotMaps


def test_marks_at_every_bit_position_and_the_last_partial_byte() -> None:
    h = HotMaps(21)                       # 3 bytes, the last one partial
    assert len(h.current) == 3 and h.nbytes == 6
    for i in (0, 7, 8, 15, 20):
        h.mark(i)
    h.mark(7)                             # marking twice is one mark
    assert h.indices().tolist() == [0, 7, 8, 15, 20]


def test_a_phase_swaps_in_the_cleared_spare_and_keeps_both_buffers() -> None:
    h = HotMaps(64)
    a, b = h.current, h.spare
    h.mark(3)
    assert h.swap() is b and h.indices().tolist() == []
    a[0] |= 1 << 5                        # a late mark into the retired map is not seen...
    h.mark(9)
    assert h.indices().tolist() == [9]
    assert h.swap() is a and h.indices().tolist() == []   # ...and is cleared when it comes back
    assert {id(h.current), id(h.spare)} == {id(a), id(b)}
