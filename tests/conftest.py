"""Shared test set-up: keep every test's state out of the real /var/lib/azqemu unless asked."""

from hypothesis import settings

# Hypothesis' per-example deadline (200 ms) measures wall time on a shared 2-core host where
# guests and other jobs run beside the tests: a slow example is not a wrong one. The examples
# still run; only the timing verdict goes (speed is the benchmarks' business).
settings.register_profile("azqemu", deadline=None)
settings.load_profile("azqemu")
