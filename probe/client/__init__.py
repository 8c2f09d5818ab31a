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

from typing import Any

from probe.client.client import Client, connect
from probe.client.results import ColumnInfo, EvalResult, Frame, Rows, TableInfo
from probe.client.sources import Source, SourceKind, register_kind
from probe.client.targets import Target, parse_target

__all__ = ["Client", "connect", "attach", "Target", "parse_target", "Rows", "EvalResult", "Frame", "TableInfo",
           "ColumnInfo", "Source", "SourceKind", "register_kind"]


def attach(pid: int, timeout: float = 5.0, **options: Any) -> Client:
    """Start an agent in process ``pid`` (injecting it when none runs) and return a client of it.

    ``options`` are agent options (``listen``, ``eval_enabled``, ...). Needs gdb and ptrace permission.
    """
    from probe.agent.options import AgentOptions
    from probe.injector import inject

    result = inject(int(pid), AgentOptions(**options) if options else None, timeout=timeout)
    # The agent derives its socket from its own environment; the injector knows where that is.
    return connect("unix:" + result.socket_path)
