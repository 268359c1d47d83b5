"""The compress and restore duration histograms (Prometheus), observed where each completes.

A leaf module (prometheus-client only) so ``memsvc`` can observe into them without importing
the metrics collector, which reads the whole daemon (``daemon/metrics.py`` serves them).
They belong to no registry until the metrics listener registers them: observing costs a
few hundred nanoseconds and nothing else when nobody scrapes.
"""

from __future__ import annotations

from prometheus_client import Histogram

COMPRESS_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RESTORE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)

COMPRESS_SECONDS = Histogram("azqemu_compress_duration_seconds",
                             "Time to compress one sandbox's RAM (scan, encode, punch)",
                             buckets=COMPRESS_BUCKETS_S, registry=None)
RESTORE_SECONDS = Histogram("azqemu_restore_duration_seconds",
                            "Time to bring a compressed sandbox's hot set back before its vCPUs continue",
                            buckets=RESTORE_BUCKETS_S, registry=None)
