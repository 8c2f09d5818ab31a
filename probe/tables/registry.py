"""The table registry: the single source for listing tables, their schemas, and producing their rows.

Built-in tables register through :func:`register_table`, the same call users make for their own.
Stdlib only; Python 3.9+.
"""

import sys
import threading
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from probe.tables.spec import Column, RowsFn, TableSpec

__all__ = ["register_table", "unregister_table", "get_table", "list_tables", "produce_rows", "produce_columns",
           "produce_arrow"]

_lock = threading.Lock()
_tables: Dict[str, TableSpec] = {}
_builtins_lock = threading.Lock()
_builtins_loaded = False

ColumnLike = Union[Column, Tuple[str, str], Tuple[str, str, str], Dict[str, str]]


def register_table(
    name: str,
    columns: Sequence[ColumnLike],
    rows_fn: RowsFn,
    description: str,
    example: Optional[str] = None,
    replace: bool = True,
) -> TableSpec:
    """Make ``SELECT * FROM name`` work in this process's agent.

    ``columns``: :class:`Column` objects, ``(name, type[, description])`` tuples or dicts with those
    keys. ``rows_fn()``: called for every query that names the table; returns tuples in column order,
    or dicts keyed by column name, or one dict mapping each column name to its list of values, or
    (fastest, for large tables) a ``pyarrow.Table`` with the declared columns, which a query uses as it
    is. Return Arrow only when pyarrow is imported already (``"pyarrow" in sys.modules``): the agent
    imports it at the first query, never before.
    """
    spec = TableSpec(name, description, tuple(_as_column(c) for c in columns), rows_fn, example)
    with _lock:
        if not replace and name in _tables:
            raise ValueError("table %r is already registered" % name)
        _tables[name] = spec
    return spec


def unregister_table(name: str) -> None:
    with _lock:
        _tables.pop(name, None)


def get_table(name: str) -> Optional[TableSpec]:
    _load_builtins()
    return _tables.get(name)


def list_tables() -> List[TableSpec]:
    _load_builtins()
    with _lock:
        return sorted(_tables.values(), key=lambda s: s.name)


def produce_rows(spec: TableSpec) -> List[Tuple[Any, ...]]:
    """Call the table's rows function and normalise its rows to tuples in column order."""
    produced = spec.rows()
    if isinstance(produced, dict):
        return list(zip(*_checked_columns(spec, produced)))
    if _is_arrow(produced):
        return list(zip(*_arrow_columns(spec, produced)))
    return _normalised_rows(spec, produced)


def produce_columns(spec: TableSpec) -> List[List[Any]]:
    """Call the table's rows function; its values as one list per column, in column order."""
    produced = spec.rows()
    if isinstance(produced, dict):
        return _checked_columns(spec, produced)
    if _is_arrow(produced):
        return _arrow_columns(spec, produced)
    rows = _normalised_rows(spec, produced)
    if not rows:
        return [[] for _ in spec.columns]
    return [list(values) for values in zip(*rows)]


def produce_arrow(spec: TableSpec) -> Any:
    """Call the table's rows function; its rows as a ``pyarrow.Table`` of exactly the declared schema.

    A rows function that gives Arrow itself is passed through (cast only where its types differ);
    imports pyarrow first, so such a function finds it loaded.
    """
    import pyarrow as pa

    from probe.tables.arrow import from_columns, schema_of

    produced = spec.rows()
    declared = [(c.name, c.type) for c in spec.columns]
    if isinstance(produced, pa.Table):
        schema = schema_of(declared)
        if produced.schema.equals(schema):
            return produced
        try:
            return produced.select(spec.column_names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
            raise ValueError("table %s: the rows function's Arrow table does not fit the declared columns: %s"
                             % (spec.name, exc)) from None
    if isinstance(produced, dict):
        return from_columns(declared, _checked_columns(spec, produced))
    rows = _normalised_rows(spec, produced)
    return from_columns(declared, [list(values) for values in zip(*rows)] if rows else [[] for _ in declared])


def _is_arrow(produced: Any) -> bool:
    pa = sys.modules.get("pyarrow")  # an Arrow table exists only once pyarrow is loaded: no import here
    return pa is not None and isinstance(produced, pa.Table)


def _arrow_columns(spec: TableSpec, table: Any) -> List[List[Any]]:
    """A rows function's Arrow table as one list per column, as a rows function's lists would have
    them (a TIMESTAMP as integer microseconds)."""
    import pyarrow as pa

    missing = [n for n in spec.column_names if n not in table.column_names]
    if missing:
        raise ValueError("table %s: the rows function gave no values for %s" % (spec.name, ", ".join(missing)))
    out = []
    for name in spec.column_names:
        column = table.column(name)
        if pa.types.is_timestamp(column.type):
            column = column.cast(pa.timestamp("us")).cast(pa.int64())
        out.append(column.to_pylist())
    return out


def _checked_columns(spec: TableSpec, produced: Dict[str, Any]) -> List[List[Any]]:
    """A columnar table's dict of lists, checked against the spec (same names, equal lengths)."""
    missing = [n for n in spec.column_names if n not in produced]
    if missing:
        raise ValueError("table %s: the rows function gave no values for %s" % (spec.name, ", ".join(missing)))
    columns = [list(produced[n]) for n in spec.column_names]
    if len({len(c) for c in columns}) > 1:
        raise ValueError("table %s: the columns the rows function gave differ in length" % spec.name)
    return columns


def _normalised_rows(spec: TableSpec, produced: Iterable[Any]) -> List[Tuple[Any, ...]]:
    names = spec.column_names
    width = len(names)
    out: List[Tuple[Any, ...]] = []
    for row in _iterate(produced):
        if isinstance(row, dict):
            out.append(tuple(row.get(n) for n in names))
        else:
            values = tuple(row)
            if len(values) != width:
                raise ValueError("table %s: a row has %d values, the spec declares %d columns"
                                 % (spec.name, len(values), width))
            out.append(values)
    return out


def _iterate(rows: Iterable[Any]) -> Iterable[Any]:
    return rows if rows is not None else ()


def _as_column(value: ColumnLike) -> Column:
    if isinstance(value, Column):
        return value
    if isinstance(value, dict):
        return Column(value["name"], value["type"], value.get("description", ""))
    return Column(*value)


def _load_builtins() -> None:
    """Register the tables probe ships, once, on first use (not at import: starting must stay cheap)."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    with _builtins_lock:
        if _builtins_loaded:
            return
        from probe.tables.builtin import BUILTIN_MODULES

        for module in BUILTIN_MODULES:
            register_table(module.NAME, module.COLUMNS, module.rows, module.DESCRIPTION, example=module.EXAMPLE)
        _builtins_loaded = True
