"""The manager daemon: owns the sandboxes, their fault handlers and the scheduler.

``server`` speaks a line-delimited JSON protocol on a root-only unix socket and dispatches
each operation to ``manager.Manager``, a thin facade over services that each own one concern
(``lifecycle``, ``memsvc``, ``accounting``, ``reconcile``, ``schedsvc``, with the shared books
in ``registry``); ``client`` is what the CLI uses, ``proc`` starts a daemon for the demo and
the tests.
"""
