"""The locked-down DuckDB engine that runs SQL over virtual tables.

Used for the agent (tables produced in the target) and, where the target cannot import DuckDB or
pyarrow, by the client over table data it fetched from the agent. The engine does not know where
tables come from: it is given a function that produces a named table as Arrow data. Callers run it through
``probe.engine.isolated.IsolatedEngine``: in a worker process whose address space the kernel bounds
(``probe.engine.worker``), since no bound inside one process holds against a single call that builds a
gigabyte.
"""

from probe.engine.result import QueryResult
from probe.engine.sandbox import Engine, TableSource, referenced_tables

__all__ = ["Engine", "TableSource", "QueryResult", "referenced_tables"]
