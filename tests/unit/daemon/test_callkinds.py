"""Tool calls told apart by kind (daemon/callkinds.py): which calls are one kind, and what a
resume for each is predicted to need."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from azqemu.bench import workload
from azqemu.daemon.callkinds import (
    FAULT_STALL_S,
    MAX_EARLY_PAGES,
    MAX_WORDS,
    PREFETCH_SKIP_MIN_S,
    PREFETCH_SKIP_SHARE,
    CallKinds,
    KindBook,
    SplitResume,
    command_words,
    jaccard,
    prefetch_pays,
)

PAGES = 4096


def _sh(script: str) -> list[str]:
    return ["/bin/sh", "-c", script]


def test_numbers_and_quoting_do_not_make_a_new_kind() -> None:
    kinds = CallKinds(PAGES)
    assert command_words(_sh("make all")).tolist() == command_words(["make all"]).tolist()   # the shell: no kind
    a = kinds.note(_sh("timeout 280 /run/kheap/cell <<'PY'\nrng = random.Random(123)\nrows[77] = 1\nPY"))
    b = kinds.note(_sh('timeout 280 /run/kheap/cell <<"PY"\nrng = random.Random(98765)\nrows[4] = 2\nPY'))
    c = kinds.note(_sh("git log --oneline | head -n 5"))
    assert a == b
    assert c != a
    assert kinds.kinds == 2


@pytest.mark.parametrize("name", workload.builtin_names())
def test_calls_that_differ_only_in_numbers_are_one_kind(name: str) -> None:
    plan = workload.load(name).plan(2, seed=3)
    kinds = CallKinds(PAGES, max_kinds=64)
    by_text: dict[str, int] = {}
    for step in itertools.chain.from_iterable(plan):
        kid = kinds.note(_sh(step.tool))
        assert by_text.setdefault(re.sub(r"\d+", "0", step.tool), kid) == kid


def test_the_heap_walk_the_load_and_the_update_of_a_code_interpreter_are_different_kinds() -> None:
    """long-lived-heap's calls that touch different parts of the heap never share a kind
    (the small `inspect` and `summary` reads may: their words overlap by 0.56-0.6)."""
    plan = workload.load("long-lived-heap").plan(4, seed=3)
    kinds = CallKinds(PAGES, max_kinds=64)
    seen: dict[int, set[str]] = {}
    for step in itertools.chain.from_iterable(plan):
        seen.setdefault(kinds.note(_sh(step.tool)), set()).add(step.label)
    heavy = {"aggregate", "update", "load", "drop"}
    assert all(len(labels & heavy) <= 1 for labels in seen.values()), seen
    assert heavy <= set().union(*seen.values())


def test_stdin_code_tells_kinds_apart() -> None:
    kinds = CallKinds(PAGES)
    a = kinds.note(["python3", "-"], stdin=b"import json\nfor row in table: total += row.price\n")
    b = kinds.note(["python3", "-"], stdin=b"import subprocess\nsubprocess.run(['make', 'check'])\n")
    assert a != b


def test_a_named_kind_matches_only_its_name() -> None:
    kinds = CallKinds(PAGES)
    named = kinds.note(_sh("pytest -q tests"), name="run_tests")
    unnamed = kinds.note(_sh("pytest -q tests"))
    assert named != unnamed
    assert kinds.note(_sh("ls -la"), name="run_tests") == named


def test_prediction_is_the_kinds_last_phase_plus_what_the_last_phase_created() -> None:
    kinds = CallKinds(PAGES)
    walk = kinds.note(_sh("python3 walk_heap.py --all"))
    assert kinds.predict(walk) is None            # no phase of it ended: the caller's fallback
    kinds.end_phase(np.arange(100, 200), fresh=np.empty(0, dtype=np.int64))
    load = kinds.note(_sh("python3 load_rows.py --chunk 5000"))
    assert kinds.predict(load) is None
    kinds.end_phase(np.arange(1000, 1100), fresh=np.arange(1000, 1050))
    # The walk gets its own pages back, and the rows the load just made.
    np.testing.assert_array_equal(kinds.predict(walk), np.concatenate([np.arange(100, 200), np.arange(1000, 1050)]))
    np.testing.assert_array_equal(kinds.predict(load), np.arange(1000, 1100))
    assert kinds.predict(None) is None


def test_every_kind_called_in_a_phase_gets_its_working_set() -> None:
    kinds = CallKinds(PAGES)
    a = kinds.note(_sh("make build"))
    b = kinds.note(_sh("grep -rn TODO src"))
    kinds.end_phase(np.array([5, 9, PAGES - 1, PAGES + 7]), fresh=np.empty(0, dtype=np.int64))
    np.testing.assert_array_equal(kinds.predict(a), [5, 9, PAGES - 1])   # out of range: ignored
    np.testing.assert_array_equal(kinds.predict(b), [5, 9, PAGES - 1])
    # The set is shared between them, and counted once: three u32 indices.
    assert kinds.nbytes == 3 * 4 + sum(len(command_words(_sh(c))) * 8 for c in ("make build", "grep -rn TODO src"))


def test_a_large_working_set_is_kept_as_a_bit_per_page() -> None:
    kinds = CallKinds(PAGES)
    kinds.note(_sh("python3 walk_heap.py"))
    heap = np.arange(0, PAGES, 3)
    kinds.end_phase(heap, fresh=np.empty(0, dtype=np.int64))
    assert kinds.nbytes == PAGES // 8 + len(command_words(_sh("python3 walk_heap.py"))) * 8
    np.testing.assert_array_equal(kinds.predict(kinds.note(_sh("python3 walk_heap.py"))), heap)


def test_the_least_recently_used_kind_goes_first() -> None:
    kinds = CallKinds(PAGES, max_kinds=3)
    ids = [kinds.note(_sh(cmd)) for cmd in ("make all", "pytest tests", "git status")]
    kinds.note(_sh("make all"))                   # used again: pytest is now the oldest
    d = kinds.note(_sh("cargo build"))
    assert kinds.kinds == 3
    assert kinds.note(_sh("make all")) == ids[0]
    assert kinds.note(_sh("git status")) == ids[2]
    assert kinds.note(_sh("pytest tests")) not in ids + [d]   # forgotten: a new kind


def test_words_are_bounded_and_jaccard_is_symmetric() -> None:
    long = " ".join(f"word_{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}{chr(97 + i // 676)}" for i in range(2000))
    assert len(command_words([long])) == MAX_WORDS
    a, b = command_words(["cat /etc/passwd"]), command_words(["cat /etc/hosts"])
    assert jaccard(a, b) == jaccard(b, a) == pytest.approx(2 / 4)
    assert jaccard(command_words(["1 2 3"]), command_words(["4"])) == 1.0     # no words at all


def test_a_first_call_of_a_kind_gets_what_a_siblings_last_call_of_it_used() -> None:
    book = KindBook()
    a, b = CallKinds(PAGES, siblings=book), CallKinds(PAGES, siblings=book)
    a.note(_sh("python3 - <<'PY'\nimport gc\nfor key in sorted(loaded)[:-1]: del loaded[key]\ngc.collect()\nPY"))
    a.end_phase(np.arange(0, 3000), fresh=np.empty(0, dtype=np.int64))
    kid = b.note(_sh("python3 - <<'PY'\nimport gc\nfor key in sorted(loaded)[:-2]: del loaded[key]\ngc.collect()\nPY"))
    np.testing.assert_array_equal(b.predict(kid), np.arange(0, 3000))
    # Its own phase, once one ended, comes first.
    b.end_phase(np.arange(10, 20), fresh=np.empty(0, dtype=np.int64))
    np.testing.assert_array_equal(b.predict(kid), np.arange(10, 20))
    # A kind no sibling ran: nothing to predict.
    assert b.predict(b.note(_sh("make -j2 all"))) is None
    # A sibling's set of another RAM size (never within one template) is not used.
    other = CallKinds(PAGES * 2, siblings=book)
    other.note(_sh("cargo test --release"))
    other.end_phase(np.arange(0, PAGES * 2, 2), fresh=np.empty(0, dtype=np.int64))
    assert len(b.predict(b.note(_sh("cargo test --release")))) == 0


def test_a_book_keeps_its_most_recent_kinds() -> None:
    book = KindBook(max_kinds=2)
    for cmd in ("make all", "pytest tests", "git status"):
        book.publish(None, command_words([cmd]), np.arange(3, dtype=np.uint32))
    assert book.look_up(None, command_words(["make all"])) is None
    assert book.look_up(None, command_words(["git status"])) is not None
    assert book.look_up("git", command_words(["git status"])) is None     # a named kind is its name
    assert book.nbytes == sum(len(command_words([c])) * 8 + 12 for c in ("pytest tests", "git status"))


def test_only_pages_trims_dropped_in_this_phase_are_refilled() -> None:
    kinds = CallKinds(PAGES)
    kinds.note(_sh("python3 walk_heap.py"))
    kinds.note_trimmed(np.array([7, 3, 50]))
    kinds.note_trimmed(np.array([3, 9]))
    np.testing.assert_array_equal(kinds.trimmed(np.arange(0, 10)), [3, 7, 9])
    kinds.end_phase(np.arange(10), fresh=np.empty(0, dtype=np.int64))    # a compression: a new phase
    assert len(kinds.trimmed(np.arange(0, 100))) == 0


def test_a_kind_that_runs_long_gets_no_prefetch() -> None:
    """The faults a prediction would save weighed against the call it precedes: an unknown
    length prefetches; 1,000 pages (~0.1 s of faults) pay before a 0.5 s call (a short call
    always keeps its prefetch), not before a 30 s one."""
    kinds = CallKinds(PAGES)
    kid = kinds.note(_sh("python3 -m compileall -q /usr/lib/python3.11/json"))
    assert kinds.call_s(kid) is None and prefetch_pays(1000, kinds.call_s(kid))
    kinds.note_end(kid, 30.0)
    assert kinds.call_s(kinds.note(_sh("python3 -m compileall -q /usr/lib/python3.11/email"))) == 30.0
    assert not prefetch_pays(1000, kinds.call_s(kid))
    assert prefetch_pays(1000, 0.5) and prefetch_pays(10, 4.0)     # a short call keeps its prefetch
    kinds.note_end(None, 1.0)                       # a call the manager does not serve: nothing noted
    assert kinds.call_s(None) is None
    # The boundary: the faults stall for exactly the share of the call.
    pages = 10000
    at = pages * FAULT_STALL_S / PREFETCH_SKIP_SHARE
    assert at > PREFETCH_SKIP_MIN_S
    assert prefetch_pays(pages, 0.99 * at) and not prefetch_pays(pages, 1.01 * at)


def test_a_busy_host_makes_faults_dearer_and_the_prefetch_pay_again() -> None:
    """A fault costs the idle host's stall plus the vCPU's wait for a CPU after it, measured
    over the sandbox's last call: where 16 guests share two cores (ms a wake-up), 3,000 pages
    are worth placing before a 10 s call that the idle figure would leave to 3,000 faults."""
    kinds = CallKinds(PAGES)
    kid = kinds.note(_sh("cd /workspace/mono && git add -A && git commit -q -m step"))
    assert kinds.fault_stall_s() == FAULT_STALL_S                   # nothing measured yet
    kinds.note_end(kid, 10.0, wake_s=None)
    assert kinds.fault_stall_s() == FAULT_STALL_S
    assert not prefetch_pays(3000, kinds.call_s(kid), kinds.fault_stall_s())
    kinds.note_end(kid, 10.0, wake_s=0.003)
    assert kinds.fault_stall_s() == pytest.approx(FAULT_STALL_S + 0.003)
    assert prefetch_pays(3000, kinds.call_s(kid), kinds.fault_stall_s())
    kinds.note_end(None, 2.0, wake_s=20e-6)          # any call of the sandbox measures the host
    assert kinds.fault_stall_s() == pytest.approx(FAULT_STALL_S + 20e-6)
    assert not prefetch_pays(3000, kinds.call_s(kid), kinds.fault_stall_s())


def test_pages_a_guest_touched_before_the_prefetch_go_first_next_time() -> None:
    """The early set: what the last resume beside a call placed first, and what the guest
    touched before the prefetch got there; only pages of the coming prediction; bounded."""
    calls = CallKinds(pages=100_000)
    want = np.arange(0, 10_000, dtype=np.int64)
    assert len(calls.early(want)) == 0
    calls.note_early(np.empty(0, np.int64), np.array([70, 5, 9_000, 20_000]))
    assert list(calls.early(want)) == [5, 70, 9_000]          # 20,000 is not predicted now
    calls.note_early(np.array([5, 70]), np.array([42]))          # placed early, and a new loser
    assert list(calls.early(want)) == [5, 42, 70]
    many = np.arange(50_000, 50_000 + MAX_EARLY_PAGES + 10)
    calls.note_early(np.arange(MAX_EARLY_PAGES), many)           # past the bound: the newest losers
    assert list(calls.early(many)) == list(many[:MAX_EARLY_PAGES])


def test_a_split_resume_places_the_early_pages_then_the_rest_and_learns() -> None:
    calls = CallKinds(pages=1_000)
    calls.note_early(np.empty(0, np.int64), np.array([3, 7]))
    split = SplitResume(calls)
    want = np.arange(10, dtype=np.int64)
    assert list(split.pages("all", want, compressed=True)) == list(range(10))
    assert list(split.pages("early", want, compressed=False)) == []      # running: nothing races
    early = split.pages("early", want, compressed=True)
    assert list(early) == [3, 7]
    split.early_done(early, 0.002)
    assert list(split.pages("rest", want, compressed=True)) == [0, 1, 2, 4, 5, 6, 8, 9]
    assert split.rest_done(np.array([0, 1])) == (2, 0.002)       # one resume: both parts counted
    assert list(calls.early(want)) == [0, 1, 3, 7]                 # the new losers go first next time
    assert list(split.pages("rest", want, compressed=True)) == list(range(10))   # reset
