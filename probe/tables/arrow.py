"""Rows with declared column types -> a ``pyarrow.Table`` whose schema is exactly the declared one.

Building the table with explicit types is also the check that a table's rows match its spec: a value of
the wrong type raises here. pyarrow is imported inside the functions: only a query needs it.
"""

from functools import lru_cache
from typing import Any, Sequence, Tuple

__all__ = ["arrow_type", "to_arrow", "from_columns", "schema_of"]


def arrow_type(sql_type: str) -> Any:
    return _arrow_types()[sql_type]


@lru_cache(maxsize=1)
def _arrow_types() -> Any:
    import pyarrow as pa

    return {
        "BOOLEAN": pa.bool_(),
        "INTEGER": pa.int32(),
        "BIGINT": pa.int64(),
        "DOUBLE": pa.float64(),
        "VARCHAR": pa.string(),
        "TIMESTAMP": pa.timestamp("us"),
        "VARCHAR[]": pa.list_(pa.string()),
    }


def schema_of(columns: Sequence[Tuple[str, str]]) -> Any:
    return _schema(tuple((name, sql_type) for name, sql_type in columns))


@lru_cache(maxsize=64)  # a schema per table (pyarrow schemas are immutable); bounded for user tables
def _schema(columns: Tuple[Tuple[str, str], ...]) -> Any:
    import pyarrow as pa

    return pa.schema([(name, arrow_type(sql_type)) for name, sql_type in columns])


def to_arrow(columns: Sequence[Tuple[str, str]], rows: Sequence[Sequence[Any]]) -> Any:
    """``columns``: (name, SQL type) pairs; ``rows``: tuples in column order."""
    return from_columns(columns, list(zip(*rows)) if rows else [() for _ in columns])


def from_columns(columns: Sequence[Tuple[str, str]], data: Sequence[Sequence[Any]]) -> Any:
    """``columns``: (name, SQL type) pairs; ``data``: one sequence of values per column."""
    import pyarrow as pa

    schema = schema_of(columns)
    arrays = []
    for (name, _), field, values in zip(columns, schema, data):
        try:
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise ValueError("column %r (%s): %s" % (name, field.type, exc)) from None
    return pa.Table.from_arrays(arrays, schema=schema)
