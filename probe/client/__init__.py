"""The client library: everything the CLI does, a script or notebook can do.

    c = probe.connect("node7:9700", token_file="tok")
    c.query("SELECT * FROM process.info")      # a pyarrow.Table
    c.eval("print(model)").stdout

Layout, bottom up: ``transport`` and ``proof`` (the wire), ``targets``, ``results``; ``connection`` (one
request to one agent, watched), ``explain`` and ``fallback`` (when it cannot answer), ``client`` (the
operations); ``sources`` (the Source interface every kind satisfies, and the registry of kinds defined
above the client); ``members``, ``listing``, ``cluster``, ``via_helpers``, ``slurm`` (every rank);
``query_plan`` (a query planned once, fetched and combined).
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from probe.client.client import Client, connect
    from probe.client.results import ColumnInfo, EvalResult, Frame, Rows, TableInfo
    from probe.client.sources import Source, SourceKind, register_kind
    from probe.client.targets import Target, parse_target

__all__ = ["Client", "connect", "attach", "Target", "parse_target", "Rows", "EvalResult", "Frame", "TableInfo",
           "ColumnInfo", "Source", "SourceKind", "register_kind"]

_LAZY = {
    "Client": "probe.client.client", "connect": "probe.client.client",
    "ColumnInfo": "probe.client.results", "EvalResult": "probe.client.results", "Frame": "probe.client.results",
    "Rows": "probe.client.results", "TableInfo": "probe.client.results",
    "Source": "probe.client.sources", "SourceKind": "probe.client.sources", "register_kind": "probe.client.sources",
    "Target": "probe.client.targets", "parse_target": "probe.client.targets",
}
"""The names above, imported on first use: a module of the package (``probe.client.explain``, which
``probe PID backtrace`` of a process without agent imports, ``probe.cli.quick``) loads without the rest."""


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError("module %r has no attribute %r" % (__name__, name)) from None
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def attach(pid: int, timeout: float = 5.0, **options: Any) -> Client:
    """Start an agent in process ``pid`` (injecting it when none runs) and return a client of it.

    ``options`` are agent options (``listen``, ``eval_enabled``, ...). Needs gdb and ptrace permission.
    """
    from probe.agent.options import AgentOptions
    from probe.client.client import connect
    from probe.injector import inject

    result = inject(int(pid), AgentOptions(**options) if options else None, timeout=timeout)
    # The agent derives its socket from its own environment; the injector knows where that is.
    return connect("unix:" + result.socket_path)
