"""Runs inside the guest: a heap of pages that compress to about a quarter each and match
nothing else (1 KiB of random bytes, then zeros), verified continuously; on request, three
of every four pages are given back to the kernel (MADV_DONTNEED: init_on_free zeroes them)
and the rest stay verified. Writes "OK <rounds> <kept pages>" or "BAD <detail>" to a status
file. Used by the compaction crash tests: the stored blobs of the freed pages die scattered
among live ones, which leaves an arena mostly dead and makes the store compact it."""

import hashlib
import mmap
import os
import sys
import time

n_pages = int(sys.argv[1])
status_path = sys.argv[2]
free_flag = sys.argv[3]
PAGE = 4096

# Private: MADV_DONTNEED frees a private anonymous page (a shared one would stay in shmem).
heap = mmap.mmap(-1, n_pages * PAGE, flags=mmap.MAP_PRIVATE)
expect = []
for i in range(n_pages):
    page = os.urandom(1024) + bytes(PAGE - 1024)
    heap[i * PAGE:(i + 1) * PAGE] = page
    expect.append(hashlib.md5(page).digest())
kept = list(range(n_pages))
freed = False


def status(line: str) -> None:
    with open(status_path + ".tmp", "w") as f:
        f.write(line + "\n")
    os.replace(status_path + ".tmp", status_path)


rounds = 0
while True:
    if not freed and os.path.exists(free_flag):
        for i in range(n_pages):
            if i % 4:
                heap.madvise(mmap.MADV_DONTNEED, i * PAGE, PAGE)
        kept = list(range(0, n_pages, 4))
        freed = True
    for i in kept:
        if hashlib.md5(heap[i * PAGE:(i + 1) * PAGE]).digest() != expect[i]:
            status(f"BAD page {i} round {rounds}")
            sys.exit(1)
    if freed:
        for i in range(1, n_pages, 4):       # given back: an anonymous page reads as zeros
            if heap[i * PAGE:(i + 1) * PAGE].count(0) != PAGE:
                status(f"BAD freed page {i} not zero round {rounds}")
                sys.exit(1)
    rounds += 1
    status(f"OK {rounds} {len(kept)}")
    time.sleep(0.1)
