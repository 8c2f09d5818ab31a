"""SQL run by the client, for agents whose process cannot import DuckDB or pyarrow.

The agent still produces its tables' raw rows; the client fetches the tables a query names and runs
the query in the same locked-down engine the agent would use.
"""

import datetime
from typing import TYPE_CHECKING, Any, Optional

from probe.client.results import Rows

if TYPE_CHECKING:
    from probe.client.client import Client

__all__ = ["run_locally", "run_on_stacks", "rows_of"]


def run_locally(client: "Client", sql: str, max_rows: Optional[int], timeout: Optional[float]) -> Any:
    from probe.engine import Engine
    from probe.errors import NotFound
    from probe.tables.arrow import to_arrow

    def fetch(name: str) -> Any:
        try:
            rows = client.table_rows(name)
        except NotFound:
            return None
        return to_arrow(rows.columns, [_revive(rows.columns, r) for r in rows.rows])

    engine = Engine(fetch)
    try:
        result = engine.query(sql, max_rows=max_rows, timeout=timeout)
    finally:
        engine.close()
    return result.table.replace_schema_metadata({"probe.truncated": "true" if result.truncated else "false"})


def run_on_stacks(sql: str, stacks: Any, max_rows: Optional[int], timeout: Optional[float], why: Any,
                  label: str) -> Any:
    """SQL over stacks read from outside a process (``probe.reader``): ``python.backtrace`` is there;
    any other table needs the agent, and the error says why it cannot answer."""
    from probe.engine import Engine
    from probe.errors import AgentBlocked, ProcessDead
    from probe.tables.arrow import to_arrow
    from probe.tables.python_backtrace import COLUMNS

    def fetch(name: str) -> Any:
        if name == "python.backtrace":
            return to_arrow(tuple((c.name, c.type) for c in COLUMNS), stacks.rows())
        reason = why.message if why is not None else "%s is read from outside" % label
        cls = type(why) if isinstance(why, (AgentBlocked, ProcessDead)) else ProcessDead
        raise cls("%s needs the agent, and %s" % (name, reason[0].lower() + reason[1:]),
                  hint="only python.backtrace is read from outside the process")

    engine = Engine(fetch)
    try:
        result = engine.query(sql, max_rows=max_rows, timeout=timeout)
    finally:
        engine.close()
    return result.table.replace_schema_metadata({"probe.truncated": "true" if result.truncated else "false",
                                                 "probe.source": stacks.source})


def rows_of(table: Any) -> Rows:
    columns = tuple((f.name, str(f.type)) for f in table.schema)
    values = [col.to_pylist() for col in table.columns]
    truncated = (table.schema.metadata or {}).get(b"probe.truncated") == b"true"
    return Rows(columns, [list(r) for r in zip(*values)] if values else [], truncated)


def _revive(columns: Any, row: Any) -> Any:
    """JSON carried timestamps as text; turn them back into datetimes for their declared type."""
    out = list(row)
    for i, (_, sql_type) in enumerate(columns):
        if sql_type == "TIMESTAMP" and isinstance(out[i], str):
            out[i] = datetime.datetime.fromisoformat(out[i])
    return out
