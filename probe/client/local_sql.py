"""SQL run by the client, in the same locked-down engine the agent would use: for agents whose process
cannot import DuckDB or pyarrow (the agent still produces its tables' raw rows; the client fetches the
tables a query names), over stacks read from outside, and over a job's member list (``cluster.ranks``).
"""

import re
from typing import TYPE_CHECKING, Any, Optional

from probe.client.results import Rows

if TYPE_CHECKING:
    from probe.client.client import Client

__all__ = ["run_locally", "run_on_stacks", "run_on_members", "names_members", "rows_of"]


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
        how = getattr(why, "hint", None)  # how to get an agent, where one can be had
        raise cls("%s needs the agent, and %s" % (name, reason[0].lower() + reason[1:]),
                  hint="only python.backtrace is read from outside the process" + ("; %s" % how if how else ""))

    engine = Engine(fetch)
    try:
        result = engine.query(sql, max_rows=max_rows, timeout=timeout)
    finally:
        engine.close()
    return result.table.replace_schema_metadata({"probe.truncated": "true" if result.truncated else "false",
                                                 "probe.source": stacks.source})


_MEMBERS = re.compile(r'\b"?cluster"?\s*\.\s*"?ranks"?(?![A-Za-z0-9_])', re.IGNORECASE)


def names_members(sql: str) -> bool:
    """Whether ``sql`` reads ``cluster.ranks``: the job's member list, answered by the client. DuckDB's
    parser decides (a string that spells the name does not count), once the text mentions it at all."""
    if not _MEMBERS.search(sql):
        return False
    import duckdb

    from probe.engine.sandbox import referenced_tables
    from probe.errors import SQLError

    connection = duckdb.connect(":memory:", config={"enable_external_access": False})
    try:
        return "cluster.ranks" in referenced_tables(sql, connection)
    except SQLError:
        return False  # not SQL: the agent says what is wrong with it
    finally:
        connection.close()


def run_on_members(sql: str, members: Any, max_rows: Optional[int], timeout: Optional[float]) -> Any:
    """SQL over a job's member list (``cluster.ranks``, as the host helpers report it), run here: the
    list is the helpers', not any rank's, so a query over it reaches no rank."""
    from probe.engine import Engine
    from probe.errors import UsageError

    def fetch(name: str) -> Any:
        if name == "cluster.ranks":
            return members
        raise UsageError("%s is a rank's table, and cluster.ranks is the job's member list, read here from the "
                         "host helpers: one query cannot read both" % name,
                         hint="ask every rank with --all-ranks (its rows carry rank and host), and group them "
                              "with --merge 'SELECT ... FROM result'")

    engine = Engine(fetch)
    try:
        result = engine.query(sql, max_rows=max_rows, timeout=timeout)
    finally:
        engine.close()
    return result.table


def rows_of(table: Any) -> Rows:
    columns = tuple((f.name, str(f.type)) for f in table.schema)
    values = [col.to_pylist() for col in table.columns]
    truncated = (table.schema.metadata or {}).get(b"probe.truncated") == b"true"
    return Rows(columns, [list(r) for r in zip(*values)] if values else [], truncated)


def _revive(columns: Any, row: Any) -> Any:
    """JSON carried timestamps as text; turn them back into datetimes for their declared type."""
    import datetime  # here, not for every query the CLI runs

    out = list(row)
    for i, (_, sql_type) in enumerate(columns):
        if sql_type == "TIMESTAMP" and isinstance(out[i], str):
            out[i] = datetime.datetime.fromisoformat(out[i])
    return out
