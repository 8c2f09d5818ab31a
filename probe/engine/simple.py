"""The simplest queries answered without DuckDB or pyarrow, which cost a process some 100 MB once loaded.

``SELECT * | col, ... FROM ns.table [ORDER BY col [ASC|DESC], ...] [LIMIT n]`` over columns of the
plain types (BOOLEAN, INTEGER, BIGINT, DOUBLE, VARCHAR) is a projection, a sort and a cut: this module
does them in Python over the table's rows, and answers exactly what the engine would (the same columns,
types, values, NULLs last, the same row cap). Anything else, and anything it is not sure of (a value
whose type is not the column's, a NaN to sort by, a result near the byte bound, another column type,
any other SQL), is left to the engine: :func:`answer` returns None and nothing has been changed.

No functions, no expressions, no second table: nothing here can reach the file system or the
interpreter, so the engine's lock-down has nothing to guard. Runs in the target; stdlib only.
"""

import math
import re
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

__all__ = ["SimpleResult", "plan", "answer"]

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_QUERY = re.compile(
    r"^\s*SELECT\s+(?P<cols>\*|%(i)s(?:\s*,\s*%(i)s)*)\s+FROM\s+(?P<table>%(i)s\.%(i)s)"
    r"(?:\s+ORDER\s+BY\s+(?P<order>%(i)s(?:\s+(?:ASC|DESC))?(?:\s*,\s*%(i)s(?:\s+(?:ASC|DESC))?)*))?"
    r"(?:\s+LIMIT\s+(?P<limit>\d{1,9}))?\s*;?\s*$" % {"i": _IDENT}, re.IGNORECASE)
# DuckDB's reserved and type/function-name keywords: none of them is a bare column reference there (a
# table's column of such a name needs quotes, which this module leaves to DuckDB).
_KEYWORDS = set("""
all analyse analyze and any array as asc asymmetric both by case cast check collate column constraint create
default deferrable desc describe distinct do else end except false fetch for foreign from grant group having
in initially intersect into lateral leading limit not null offset on only or order pivot pivot_longer
pivot_wider placing primary qualify references returning select show some summarize symmetric table then to
trailing true union unique unpivot using variadic when where window with
anti asof authorization binary collation concurrently cross freeze full generated glob ilike inner is isnull
join left like map natural notnull outer overlaps positional right semi similar struct tablesample try_cast
verbose""".split())
_INT_RANGE = {"INTEGER": (-(1 << 31), (1 << 31) - 1), "BIGINT": (-(1 << 63), (1 << 63) - 1)}
_ARROW_NAMES = {"BOOLEAN": "bool", "INTEGER": "int32", "BIGINT": "int64", "DOUBLE": "double", "VARCHAR": "string"}


class SimpleResult:
    """What :meth:`probe.engine.Engine.query` returns, for the routes' JSON answer (no Arrow)."""

    def __init__(self, columns: Sequence[Tuple[str, str]], rows: List[Tuple[Any, ...]], truncated: bool,
                 elapsed_ms: float) -> None:
        self._columns = [{"name": name, "type": _ARROW_NAMES[kind]} for name, kind in columns]
        self._rows = rows
        self.truncated = truncated
        self.elapsed_ms = elapsed_ms

    def json_head(self) -> Dict[str, Any]:
        return {"columns": self._columns, "truncated": self.truncated, "row_count": len(self._rows),
                "elapsed_ms": round(self.elapsed_ms, 3)}

    def row_chunks(self, size: int) -> Iterator[List[List[Any]]]:
        for start in range(0, len(self._rows), size):
            yield [list(row) for row in self._rows[start:start + size]]


class Plan:
    """A query this module can answer: the table, the columns to keep, the sort keys, the LIMIT."""

    def __init__(self, table: str, names: Optional[List[str]], order: List[Tuple[str, bool]],
                 limit: Optional[int]) -> None:
        self.table, self.names, self.order, self.limit = table, names, order, limit


def plan(sql: str) -> Optional[Plan]:
    """The query's plan when it has the one shape answered here; None otherwise."""
    if len(sql) > 4096:
        return None
    match = _QUERY.match(sql)
    if match is None:
        return None
    cols = match.group("cols")
    names = None if cols == "*" else [c.strip().lower() for c in cols.split(",")]
    order: List[Tuple[str, bool]] = []
    for term in (match.group("order") or "").split(","):
        words = term.split()
        if words:
            order.append((words[0].lower(), len(words) > 1 and words[1].lower() == "desc"))
    idents = (names or []) + [name for name, _ in order] + match.group("table").lower().split(".")
    if any(word in _KEYWORDS for word in idents) or (names is not None and len(set(names)) != len(names)):
        return None  # a keyword where a name should be (DuckDB would parse it otherwise), or a name twice
    limit = match.group("limit")
    return Plan(match.group("table").lower(), names, order, int(limit) if limit is not None else None)


def answer(the_plan: Plan, columns: Sequence[Tuple[str, str]], produce: Callable[[], List[Tuple[Any, ...]]],
           max_rows: int, max_bytes: int) -> Optional[SimpleResult]:
    """Run ``the_plan`` over a table of ``columns`` ((name, SQL type), declared order) whose rows
    ``produce()`` gives; None where the engine must answer (nothing is kept of what was produced)."""
    started = time.perf_counter()
    index = {name: i for i, (name, _) in enumerate(columns)}
    wanted = list(index) if the_plan.names is None else the_plan.names
    if any(name not in index for name in wanted) or any(name not in index for name, _ in the_plan.order):
        return None  # the engine says which column is missing, in its words
    used = sorted({index[name] for name in wanted} | {index[name] for name, _ in the_plan.order})
    if any(columns[i][1] not in _ARROW_NAMES for i in used):
        return None
    try:
        rows = produce()
    except Exception:
        return None  # the engine produces it again, and reports what went wrong as it always does
    for i in used:
        if not _plain(columns[i][1], [row[i] for row in rows]):
            return None
    for name, descending in reversed(the_plan.order):  # stable sorts, last key first
        i = index[name]
        if columns[i][1] == "DOUBLE" and any(row[i] is not None and math.isnan(row[i]) for row in rows):
            return None  # NaN sorts above every number in DuckDB
        present = [row for row in rows if row[i] is not None]
        present.sort(key=lambda row: row[i], reverse=descending)
        rows = present + [row for row in rows if row[i] is None]  # NULLs last, ascending or descending
    if the_plan.limit is not None:
        rows = rows[:the_plan.limit]
    truncated = len(rows) > max_rows
    rows = rows[:max_rows]
    keep = [index[name] for name in wanted]
    doubles = {j for j, i in enumerate(keep) if columns[i][1] == "DOUBLE"}
    out = [tuple(float(row[i]) if j in doubles and row[i] is not None else row[i] for j, i in enumerate(keep))
           for row in rows]
    if _size(out) > max_bytes // 2:
        return None  # near the bound: the engine measures it as it always does
    return SimpleResult([columns[i] for i in keep], out, truncated, (time.perf_counter() - started) * 1000.0)


def _plain(kind: str, values: List[Any]) -> bool:
    """Every value is one the engine takes as it is for a column of type ``kind`` (None included)."""
    if kind == "VARCHAR":
        try:
            return all(v is None or (type(v) is str and v.encode("utf-8") is not None) for v in values)
        except UnicodeEncodeError:
            return False
    if kind == "BOOLEAN":
        return all(v is None or type(v) is bool for v in values)
    if kind == "DOUBLE":
        return all(v is None or type(v) is float or (type(v) is int and abs(v) < (1 << 53)) for v in values)
    low, high = _INT_RANGE[kind]
    return all(v is None or (type(v) is int and low <= v <= high) for v in values)


def _size(rows: List[Tuple[Any, ...]]) -> int:
    return sum(8 + (len(v) if type(v) is str else 0) for row in rows for v in row)
