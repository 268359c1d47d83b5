"""Benchmarks: workloads, host memory sampling, the Linux baseline configuration, reports.

- ``workload``: the YAML workload format and its per-sandbox expansion (docs/workloads.md);
- ``hostmem``: host memory time series and the per-sandbox accounting of the Linux policy;
- ``linux_config``: KSM + zram + proactive reclaim, set up and torn down leaving the host as found;
- ``report``: the density result as JSON, Markdown, PNG plots and a terminal table.
"""
