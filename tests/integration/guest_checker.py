"""Runs inside the guest: keeps a buffer of known content, keeps changing parts of it, and
verifies all of it continuously. Writes "OK <rounds> <changes>" or "BAD <detail>" to a status
file. Used by the lazy-memory tests: a guest that ever sees a wrong page reports BAD."""

import hashlib
import os
import sys
import time

size_mib = int(sys.argv[1])
status_path = sys.argv[2]
seed = sys.argv[3].encode()
CHUNK = 1 << 16
n_chunks = (size_mib << 20) // CHUNK


def content(i: int, gen: int) -> bytes:
    block = hashlib.sha256(seed + b"%d:%d" % (i, gen)).digest()
    return block * (CHUNK // len(block))


buf = bytearray(n_chunks * CHUNK)
gens = [0] * n_chunks
for i in range(n_chunks):
    buf[i * CHUNK:(i + 1) * CHUNK] = content(i, 0)
expect = [hashlib.md5(content(i, 0)).digest() for i in range(n_chunks)]
rounds = changes = 0
while True:
    # Change a few chunks (new content, new expectation), then verify everything.
    for k in range(4):
        i = (rounds * 7 + k * 13) % n_chunks
        gens[i] += 1
        data = content(i, gens[i])
        buf[i * CHUNK:(i + 1) * CHUNK] = data
        expect[i] = hashlib.md5(data).digest()
        changes += 1
    for i in range(n_chunks):
        if hashlib.md5(buf[i * CHUNK:(i + 1) * CHUNK]).digest() != expect[i]:
            with open(status_path + ".tmp", "w") as f:
                f.write(f"BAD chunk {i} gen {gens[i]} round {rounds}\n")
            os.replace(status_path + ".tmp", status_path)
            sys.exit(1)
    rounds += 1
    with open(status_path + ".tmp", "w") as f:
        f.write(f"OK {rounds} {changes}\n")
    os.replace(status_path + ".tmp", status_path)
    time.sleep(0.05)
