"""Runs inside the guest: rewrites a file's pages one at a time, in a shuffled order, at a
steady pace, checking each page before it rewrites it. Used by the trim test: a trim that runs
beside the guest must not drop a page the sweeper wrote after the trim read it.

    guest_sweeper.py init <path> <pages>                 every page at generation 0
    guest_sweeper.py run <path> <pages> <s/page> <status>

``run`` writes "OK <pages done>" to the status file as it goes, "DONE <pages>" once every page
is at generation 1 and read back so, or "BAD <detail>" (and exits 1) at the first wrong page."""

import hashlib
import os
import random
import sys
import time

PAGE = 4096


def content(i: int, gen: int) -> bytes:
    return hashlib.sha256(b"%d:%d" % (i, gen)).digest() * (PAGE // 32)


def status(path: str, line: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(line + "\n")
    os.replace(path + ".tmp", path)


mode, path, pages = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "init":
    with open(path, "wb") as f:
        for i in range(pages):
            f.write(content(i, 0))
    sys.exit(0)
pace_s, status_path = float(sys.argv[4]), sys.argv[5]
fd = os.open(path, os.O_RDWR)
order = list(range(pages))
random.Random(1).shuffle(order)
for done, i in enumerate(order):
    if os.pread(fd, PAGE, i * PAGE) != content(i, 0):
        status(status_path, f"BAD page {i} before its rewrite ({done} done)")
        sys.exit(1)
    os.pwrite(fd, content(i, 1), i * PAGE)
    if done % 64 == 0:
        status(status_path, f"OK {done}")
    time.sleep(pace_s)
for i in range(pages):
    if os.pread(fd, PAGE, i * PAGE) != content(i, 1):
        status(status_path, f"BAD page {i} after the sweep")
        sys.exit(1)
status(status_path, f"DONE {pages}")
