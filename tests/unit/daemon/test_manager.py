"""The manager's facade: the protocol operations the CLI, the benchmarks and the
integration tests call keep their names and arguments, and the daemon's per-sandbox paths
are the clone identity's."""

from __future__ import annotations

import inspect
from typing import Any

from azqemu.daemon.manager import Manager
from azqemu.sched import policy
from azqemu.virt.identity import new_identity, vm_paths

# op -> its arguments (name, default); the /v1 routes call them by these names (azqemu/api/app.py).
OPS: dict[str, list[tuple[str, Any]]] = {
    "ping": [],
    "template_create": [("name", inspect.Parameter.empty), ("mem_mib", 512), ("vcpus", 1), ("warmup", None)],
    "template_list": [],
    "template_delete": [("name", inspect.Parameter.empty)],
    "clone": [("template", inspect.Parameter.empty), ("count", 1), ("name_prefix", None),
              ("sharing_domain", "default"), ("names", None), ("ram_mode", None), ("policy", "manual"),
              ("grace_s", policy.DEFAULT_GRACE_S)],
    "exec": [("name", inspect.Parameter.empty), ("argv", inspect.Parameter.empty), ("timeout_s", 300.0),
             ("stdin_b64", None), ("on_output", None), ("kind", None)],
    "phase": [("name", inspect.Parameter.empty), ("phase", inspect.Parameter.empty)],
    "set_policy": [("names", inspect.Parameter.empty), ("policy", inspect.Parameter.empty), ("grace_s", None),
                   ("pressure_budget_bytes", None)],
    "pause": [("name", inspect.Parameter.empty)],
    "resume": [("name", inspect.Parameter.empty), ("prefetch", True)],
    "compress": [("name", inspect.Parameter.empty)],
    "destroy": [("name", inspect.Parameter.empty)],
    "events": [("since", 0.0), ("sandbox", None), ("event", None)],
    "trim": [("name", inspect.Parameter.empty)],
    "owned": [("names", None)],
    "list": [],
    "dominfo": [("name", inspect.Parameter.empty)],
    "domstats": [("name", inspect.Parameter.empty)],
    "memstats": [("name", inspect.Parameter.empty), ("reset", False)],
}


def test_the_protocol_operations_keep_their_names_and_arguments() -> None:
    ops = {n[3:]: getattr(Manager, n) for n in dir(Manager) if n.startswith("op_")}
    assert set(ops) == set(OPS)
    for op, fn in ops.items():
        params = list(inspect.signature(fn).parameters.values())[1:]
        assert [(p.name, p.default) for p in params] == OPS[op], op


def test_the_manager_starts_over_a_host_and_answers(cfg: Any, host: Any, sandbox_meta_of: Any) -> None:
    host.add("a-0", sandbox_meta_of())
    m = Manager(cfg, host=host)
    assert m.op_ping()["sandboxes"] == 1  # adopted at start
    assert m.op_template_list() == []
    assert m.scheduler.actions is m.schedsvc
    m.op_set_policy(["a-0"], "agentzip-pressure", pressure_budget_bytes=1 << 20)
    assert m.scheduler.pressure_budget_bytes == 1 << 20
    m.op_set_policy([], "manual", pressure_budget_bytes=0)
    assert m.scheduler.pressure_budget_bytes is None


def test_paths_of_an_existing_sandbox_are_those_its_identity_gave_it(cfg: Any) -> None:
    ident, paths = new_identity("p-0"), vm_paths("p-0", cfg)
    assert paths.vm_dir == ident.vm_dir == cfg.run_dir / "vm" / "p-0"
    for attr in ("qmp_socket", "migration_socket", "uffd_socket", "guest_agent_socket", "azq_agent_socket"):
        assert getattr(paths, attr) == getattr(ident, attr)
        assert getattr(paths, attr).parent == paths.vm_dir


def test_state_changes_reach_the_domain_metadata(cfg: Any, host: Any, sandbox_meta_of: Any) -> None:
    host.add("a-0", sandbox_meta_of())
    m = Manager(cfg, host=host)
    m.start()
    try:
        m.labels_of = lambda name: {"task": "42"}
        m.op_set_policy(["a-0"], "agentzip")
        assert m.metadata.flush()
        meta = host.doms["a-0"].metadata()
        assert (meta["state"], meta["policy"], meta["compressed"], meta["stored-bytes"]) == \
            ("running", "agentzip", "no", "0")
        assert meta["role"] == "sandbox"             # what creation wrote stays
        assert host.doms["a-0"].labels == {"task": "42"}
    finally:
        m.close()
