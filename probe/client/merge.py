"""``--merge SQL``: a query over the union of every rank's rows (the table ``result``), run here.

The same lock-down as the agent's engine where it matters on a client: no file system, no extensions,
configuration locked, so a merge query reads only the rows the ranks sent."""

from typing import Any

from probe.client.wording import option
from probe.errors import SQLError

__all__ = ["merge_rows"]


def merge_rows(table: Any, sql: str) -> Any:
    """``sql`` over ``table`` (a ``pyarrow.Table``) registered as ``result``; a ``pyarrow.Table``."""
    import duckdb

    con = duckdb.connect(":memory:", config={"enable_external_access": False, "autoinstall_known_extensions": False,
                                             "autoload_known_extensions": False})
    try:
        con.register("result", table)
        con.execute("SET lock_configuration = true")
        try:
            return con.sql(sql).to_arrow_table()
        except duckdb.Error as exc:
            raise SQLError("%s: %s" % (option("--merge", "the merge query"), str(exc).strip().splitlines()[0][:500]),
                           hint="the union of the ranks' rows is the table `result`") from None
    finally:
        con.close()
