"""Guest memory: reading RAM backings, encoding pages, and the shared page store.

Modules, one concept each:
    kinds        page representations, on-disk numbers, thresholds
    ram          guest-physical layout (offset <-> gpa), reading resident pages
    template     the template image: pages, hashes, duplicate and similarity lookups
    pagehash     XXH3-128 of pages: lookup key + checksum
    zstdlib      zstd of single pages, with a reference page as raw-content prefix
    simindex     sampled block hashes (Difference Engine) for SDELTA candidates
    encoder      choosing a representation per page (vectorised first, codecs last)
    _pagecodec.c the per-page encode/decode loops in C (optional, loaded with ctypes)
    arena        arena files holding the payloads
    blobdecode   decoding blobs (single recipes, batches) outside the store's lock
    blobtable    payload locations, reference counts, per-domain indices
    sbxindex     the per-sandbox index
    persist      on-disk metadata formats
    generation   the store's on-disk generation: write (write-ahead order), load, validate
    crashpoint   named crash points (AZQ_CRASH_AT) for the kill -9 tests
    pagedecode   decoding one page or rows for the store (locate under its lock, write outside)
    domainview   the encoder's window on one sharing domain
    store        PageStore: the API for the restore path and the scheduler
    storecheck   verify every stored page (`azq store check`)
    accounting   bytes owned per sandbox / domain / host
    linux_model  the KSM + zram baseline
    analyze      `azq mem analyze`
"""

from azqemu.memory.accounting import DomainBytes, OwnedBytes, StoreBytes
from azqemu.memory.kinds import PAGE_SIZE, RAW_THRESHOLD_BYTES, Kind
from azqemu.memory.ram import GuestRamRange, RamLayout, read_resident_pages
from azqemu.memory.store import EncodeResult, NotStored, PageStore
from azqemu.memory.template import TemplateImage

__all__ = ["PAGE_SIZE", "RAW_THRESHOLD_BYTES", "DomainBytes", "EncodeResult", "Kind", "NotStored", "OwnedBytes", "PageStore",
           "GuestRamRange", "RamLayout", "StoreBytes", "TemplateImage", "read_resident_pages"]
