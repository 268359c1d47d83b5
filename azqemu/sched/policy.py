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
| agentzip-pressure   | copy-on-write   | phase-unaware: compress (and run on, lazily) the largest  |
|                     |                 | sandboxes whenever their memory crosses a budget          |

The agentzip policies clone copy-on-write, like none-cow: pages the guest only reads stay the
template's page cache, shared, from the first touch on; compression takes what the guest
wrote (sandboxmem.py). Lazy clones (``manual``, ``azq clone --mode lazy``) copy each page
they touch into their own memfd instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from azqemu.errors import ConfigError

# Compress only after the wait has lasted this long: a tool call often follows another one
# within a second (the agent issues several), and compressing in between costs a restore.
DEFAULT_GRACE_S = 1.0


@dataclass(frozen=True)
class Policy:
    name: str
    clone_mode: str               # eager | lazy | cow
    compress_on_wait: bool = False
    prefetch: bool = True
    use_siblings: bool = True
    linux_reclaim: bool = False
    pressure: bool = False

    @property
    def compresses(self) -> bool:
        return self.compress_on_wait or self.pressure


POLICIES: dict[str, Policy] = {p.name: p for p in (
    Policy("manual", "lazy"),
    Policy("none", "eager"),
    Policy("none-cow", "cow"),
    Policy("linux", "cow", linux_reclaim=True),
    Policy("agentzip", "cow", compress_on_wait=True),
    Policy("agentzip-no-prefetch", "cow", compress_on_wait=True, prefetch=False),
    Policy("agentzip-no-sibling", "cow", compress_on_wait=True, use_siblings=False),
    Policy("agentzip-pressure", "cow", pressure=True, prefetch=False),
)}


def get(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r} (one of: {', '.join(POLICIES)})") from None
