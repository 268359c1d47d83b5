"""The manager daemon: owns the sandboxes, their fault handlers and the scheduler.

``server`` speaks a line-delimited JSON protocol on a root-only unix socket, ``manager`` holds
the state and does the work, ``client`` is what the CLI uses.
"""
