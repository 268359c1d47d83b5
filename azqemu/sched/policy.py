"""Memory policies a sandbox can run under, selectable per sandbox and per benchmark run.

| policy              | clone RAM       | what happens in an LLM wait                              |
|---------------------|-----------------|----------------------------------------------------------|
| manual              | lazy (or eager) | nothing automatic: ``azq compress`` / ``azq resume``     |
| none                | eager copy      | nothing (full-copy clones)                                |
| none-cow            | copy-on-write   | nothing (pages only read stay shared with the template)  |
| linux               | copy-on-write   | MADV_PAGEOUT to zram after the grace period; KSM merges  |
| agentzip            | copy-on-write   | compress after the grace period; resume with prefetch    |
| agentzip-no-prefetch| copy-on-write   | as agentzip, but resume serves every page on first touch |
| agentzip-no-sibling | copy-on-write   | as agentzip, template-relative only (no DUP/SDELTA bases of siblings) |
| agentzip-no-trim    | copy-on-write   | as agentzip, but a long tool call keeps all it holds (ablation) |
| agentzip-steady-trims | copy-on-write | as agentzip, but trims that drop little do not slow down (ablation) |
| agentzip-prefetch-first | copy-on-write | as agentzip, but a tool call's resume puts the hot set back before the vCPUs continue (ablation) |
| agentzip-pressure   | copy-on-write   | phase-unaware: compress (and run on, lazily) the largest  |
|                     |                 | sandboxes whenever their memory crosses a budget          |

The compressing policies also trim a sandbox whose tool call runs long: every
``TRIM_EVERY_S`` after ``TRIM_AFTER_S`` of a tool call, the copies it has left alone for a
while are dropped (brought back at resume and not written since) or compressed (written,
then left), so a long tool call keeps only what it works on (``Policy.trim_in_tool``).

The agentzip policies clone copy-on-write, like none-cow: pages the guest only reads stay the
template's page cache, shared, from the first touch on; compression takes what the guest
wrote (sandboxmem.py). Lazy clones (``manual``, ``azq clone --mode lazy``) copy each page
they touch into their own memfd instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from azqemu.errors import ConfigError

# Compress (or page out) only after the wait has lasted this long: an agent that issues
# several tool calls in one turn runs them back to back, tens of milliseconds apart (its own
# overhead between two execs), and compressing in between would cost a restore. An LLM's
# answer takes a second or more, so a grace above the gaps inside a turn and well below a
# second loses nothing: until the grace ends a waiting sandbox holds all its tool call left
# resident. Coding-agent at 16 x 512 MiB spent 16% of its sandbox-time there with 1.0 s
# (1.12 s from a wait's start to its compression done, of waits of 6 s on average), ~7 MiB a
# sandbox, a third of agentzip's owned memory; with 0.25 s owned fell from 32.6 to 22.7 MiB
# and host cost from 48.7 to 36.1, the median tool call 0.54 -> 0.45 s (docs/figures.md,
# session 30). The linux policy's page-out waits for the same grace.
DEFAULT_GRACE_S = 0.25
# Trimming in a tool call: a resume puts back every stored page the sandbox ever had (the hot
# set is the union of its working sets, see daemon/sandboxmem.py), which a short tool call
# wants and a long one mostly does not; and a long tool call writes outputs (build trees,
# logs, a heap) it then leaves alone. After TRIM_AFTER_S of a tool call, and every
# TRIM_EVERY_S after, a trim drops the copies left alone for the sandbox's cold age
# (daemon/coldrule.py: 2 s, adapted to how many dropped pages come back): those equal to
# their stored entries, and written ones whose hash has not moved (encoded first). A trim
# scans, hashes and encodes beside the guest and pauses its vCPUs only to check and drop.
# Measured on 4 x 512 MiB, small scale, in one run each against agentzip-no-trim (owned
# MiB, linux beside): long-lived-heap 125.8 vs 179.1 (linux 171.4), long-tools 68.0 vs 74.7
# (linux 61.7); with only the unchanged copies dropped (before the cold age) long-tools was
# 76.0 vs 74.2.
TRIM_AFTER_S = 2.0
TRIM_EVERY_S = 2.0


@dataclass(frozen=True)
class Policy:
    name: str
    clone_mode: str               # eager | lazy | cow
    compress_on_wait: bool = False
    prefetch: bool = True
    use_siblings: bool = True
    linux_reclaim: bool = False
    pressure: bool = False
    trim_in_tool: bool = False
    # A trim that dropped little makes the next wait longer (daemon/coldrule.py, pace_s).
    trim_backoff: bool = True
    # A tool call's resume continues the vCPUs first and puts the hot set back beside the
    # call (Lifecycle.exec); off: the hot set first, as ``azq resume`` always does.
    prefetch_beside: bool = True

    @property
    def compresses(self) -> bool:
        return self.compress_on_wait or self.pressure


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("manual", "lazy"),
    Policy("none", "eager"),
    Policy("none-cow", "cow"),
    Policy("linux", "cow", linux_reclaim=True),
    Policy("agentzip", "cow", compress_on_wait=True, trim_in_tool=True),
    Policy("agentzip-no-prefetch", "cow", compress_on_wait=True, prefetch=False, trim_in_tool=True),
    Policy("agentzip-no-sibling", "cow", compress_on_wait=True, use_siblings=False, trim_in_tool=True),
    Policy("agentzip-no-trim", "cow", compress_on_wait=True),
    Policy("agentzip-steady-trims", "cow", compress_on_wait=True, trim_in_tool=True, trim_backoff=False),
    Policy("agentzip-prefetch-first", "cow", compress_on_wait=True, trim_in_tool=True, prefetch_beside=False),
    Policy("agentzip-pressure", "cow", pressure=True, prefetch=False),
)}


def get(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r} (one of: {', '.join(POLICIES)})") from None
