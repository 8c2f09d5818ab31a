"""The table registry: the single source for listing tables, their schemas, and producing their rows.

Built-in tables register through :func:`register_table`, the same call users make for their own.
Stdlib only; Python 3.9+.
"""

import threading
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from probe.tables.spec import Column, RowsFn, TableSpec

__all__ = ["register_table", "unregister_table", "get_table", "list_tables", "produce_rows", "produce_columns"]

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
    or dicts keyed by column name, or (fastest) one dict mapping each column name to its list of values.
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
    return _normalised_rows(spec, produced)


def produce_columns(spec: TableSpec) -> List[List[Any]]:
    """Call the table's rows function; its values as one list per column, in column order."""
    produced = spec.rows()
    if isinstance(produced, dict):
        return _checked_columns(spec, produced)
    rows = _normalised_rows(spec, produced)
    if not rows:
        return [[] for _ in spec.columns]
    return [list(values) for values in zip(*rows)]


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
        from probe.tables import builtin

        builtin.register_all()
        _builtins_loaded = True
