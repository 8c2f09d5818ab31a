"""The simplest queries answered without DuckDB or pyarrow, which cost a process some 100 MB once loaded.

``SELECT * | col, ... FROM ns.table [WHERE ...] [ORDER BY col [ASC|DESC], ...] [LIMIT n]`` and
``SELECT count(*) [AS name] FROM ns.table [WHERE ...] [LIMIT n]`` over columns of the plain types
(BOOLEAN, INTEGER, BIGINT, DOUBLE, VARCHAR) are a filter, a projection (or a count), a sort and a cut:
this module does them in Python over the table's rows, and answers exactly what the engine would (the
same columns, types, values, NULLs last, the same row cap). The WHERE clause is terms joined by AND,
each ``col OP literal`` (OP one of = == != <> < <= > >=; a string literal for a VARCHAR column, a whole
number for an integer one, a number for a DOUBLE, TRUE or FALSE for a BOOLEAN), ``col IS [NOT] NULL``,
``col [NOT] LIKE 'pattern'`` (without a backslash) or a BOOLEAN column alone, or after NOT. Anything
else, and anything it is not sure of (a value whose type is not the column's, a NaN to sort by or to
compare, a literal of another type than its column's, a result near the byte bound, another column
type, any other SQL), is left to the engine: :func:`answer` returns None and nothing has been changed.

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
    r"^\s*SELECT\s+(?P<cols>\*|%(i)s(?:\s*,\s*%(i)s)*|(?P<count>count\s*\(\s*\*\s*\))(?:\s+AS\s+(?P<alias>%(i)s))?)"
    r"\s+FROM\s+(?P<table>%(i)s\.%(i)s)"
    r"(?:\s+WHERE\s+(?P<where>.+?))?"
    r"(?:\s+ORDER\s+BY\s+(?P<order>%(i)s(?:\s+(?:ASC|DESC))?(?:\s*,\s*%(i)s(?:\s+(?:ASC|DESC))?)*))?"
    r"(?:\s+LIMIT\s+(?P<limit>\d{1,9}))?\s*;?\s*$" % {"i": _IDENT}, re.IGNORECASE | re.DOTALL)
_TOKEN = re.compile(r"\s*(?:(?P<str>'(?:[^']|'')*')|(?P<num>-?\d{1,18}(?:\.\d{1,15})?(?![\w.]))"
                    r"|(?P<op><=|>=|<>|!=|==|=|<|>)|(?P<word>%s))" % _IDENT)
_OPS = {"=": "eq", "==": "eq", "!=": "ne", "<>": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
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
    """A query this module can answer: the table, the columns to keep (or a count), the WHERE terms,
    the sort keys, the LIMIT."""

    def __init__(self, table: str, names: Optional[List[str]], order: List[Tuple[str, bool]],
                 limit: Optional[int], where: Optional[List[Tuple[Any, ...]]] = None,
                 count: Optional[str] = None) -> None:
        self.table, self.names, self.order, self.limit = table, names, order, limit
        self.where = where or []  # (column, test, literal): test "eq" .. "ge", "null", "notnull", "like", ...
        self.count = count  # the count's column name, for SELECT count(*)


def plan(sql: str) -> Optional[Plan]:
    """The query's plan when it has a shape answered here; None otherwise."""
    if len(sql) > 4096:
        return None
    match = _QUERY.match(sql)
    if match is None:
        return None
    cols = match.group("cols")
    count = None
    if match.group("count"):
        count = match.group("alias") or "count_star()"
        if match.group("order"):
            return None  # ORDER BY a column of the table beside an aggregate: DuckDB's error
    elif match.group("alias"):
        return None
    names = None if cols == "*" or count else [c.strip().lower() for c in cols.split(",")]
    order: List[Tuple[str, bool]] = []
    for term in (match.group("order") or "").split(","):
        words = term.split()
        if words:
            order.append((words[0].lower(), len(words) > 1 and words[1].lower() == "desc"))
    where = _where(match.group("where")) if match.group("where") is not None else []
    if where is None:
        return None
    idents = (names or []) + [name for name, _ in order] + match.group("table").lower().split(".") \
        + [term[0] for term in where] + ([count.lower()] if match.group("alias") else [])
    if any(word in _KEYWORDS for word in idents) or (names is not None and len(set(names)) != len(names)):
        return None  # a keyword where a name should be (DuckDB would parse it otherwise), or a name twice
    limit = match.group("limit")
    return Plan(match.group("table").lower(), names, order, int(limit) if limit is not None else None, where, count)


def _where(text: str) -> Optional[List[Tuple[Any, ...]]]:
    """The terms of a WHERE clause of the shape answered here, as (column, test, literal); else None."""
    tokens: List[Tuple[str, str]] = []
    position = 0
    while position < len(text):
        if text[position:].strip() == "":
            break
        token = _TOKEN.match(text, position)
        if token is None or token.end() == position:
            return None
        kind = token.lastgroup or ""
        tokens.append((kind, token.group(kind)))
        position = token.end()
    terms: List[List[Tuple[str, str]]] = [[]]
    for kind, value in tokens:
        if kind == "word" and value.lower() == "and":
            terms.append([])
        else:
            terms[-1].append((kind, value))
    out = []
    for term in terms:
        parsed = _term(term)
        if parsed is None:
            return None
        out.append(parsed)
    return out


def _term(term: List[Tuple[str, str]]) -> Optional[Tuple[Any, ...]]:
    words = [value.lower() if kind == "word" else None for kind, value in term]
    if len(term) == 1 and term[0][0] == "word":
        return (words[0], "true", None)
    if len(term) == 2 and words[0] == "not" and term[1][0] == "word":
        return (words[1], "false", None)
    if not term or term[0][0] != "word":
        return None
    column, rest, rest_words = words[0], term[1:], words[1:]
    if rest_words == ["is", "null"]:
        return (column, "null", None)
    if rest_words == ["is", "not", "null"]:
        return (column, "notnull", None)
    if len(rest) in (2, 3) and rest_words[:-1] in (["like"], ["not", "like"]) and rest[-1][0] == "str":
        pattern = rest[-1][1][1:-1].replace("''", "'")
        if "\\" in pattern:
            return None  # DuckDB versions differ on an escape character
        return (column, "like" if len(rest) == 2 else "notlike", pattern)
    if len(rest) != 2 or rest[0][0] != "op":
        return None
    kind, value = rest[1]
    if kind == "str":
        literal: Any = ("str", value[1:-1].replace("''", "'"))
    elif kind == "num":
        literal = ("num", value)
    elif kind == "word" and value.lower() in ("true", "false"):
        literal = ("bool", value.lower() == "true")
    else:
        return None
    return (column, _OPS[rest[0][1]], literal)


def answer(the_plan: Plan, columns: Sequence[Tuple[str, str]], produce: Callable[[], List[Tuple[Any, ...]]],
           max_rows: int, max_bytes: int) -> Optional[SimpleResult]:
    """Run ``the_plan`` over a table of ``columns`` ((name, SQL type), declared order) whose rows
    ``produce()`` gives; None where the engine must answer (nothing is kept of what was produced)."""
    started = time.perf_counter()
    index = {name: i for i, (name, _) in enumerate(columns)}
    wanted = [] if the_plan.count else list(index) if the_plan.names is None else the_plan.names
    referenced = wanted + [name for name, _ in the_plan.order] + [term[0] for term in the_plan.where]
    if any(name not in index for name in referenced):
        return None  # the engine says which column is missing, in its words
    used = sorted({index[name] for name in referenced})
    if any(columns[i][1] not in _ARROW_NAMES for i in used):
        return None
    tests = []
    for name, test, literal in the_plan.where:
        check = _test(columns[index[name]][1], test, literal)
        if check is None:
            return None  # a literal of another type than its column's: DuckDB casts, which is left to it
        tests.append((index[name], check))
    try:
        rows = produce()
    except Exception:
        return None  # the engine produces it again, and reports what went wrong as it always does
    for i in used:
        if not _plain(columns[i][1], [row[i] for row in rows]):
            return None
    for name, _, _ in the_plan.where:
        i = index[name]
        if columns[i][1] == "DOUBLE" and any(row[i] is not None and math.isnan(row[i]) for row in rows):
            return None  # NaN compares equal to NaN and above every number in DuckDB
    for i, check in tests:
        rows = [row for row in rows if check(row[i])]
    if the_plan.count:
        out = [(len(rows),)] if the_plan.limit != 0 else []
        truncated = len(out) > max_rows
        return SimpleResult([(the_plan.count, "BIGINT")], out[:max_rows], truncated,
                            (time.perf_counter() - started) * 1000.0)
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


def _test(kind: str, test: str, literal: Any) -> Optional[Callable[[Any], bool]]:
    """The row test of one WHERE term over a column of SQL type ``kind``; None where DuckDB would cast."""
    if test == "null":
        return lambda v: v is None
    if test == "notnull":
        return lambda v: v is not None
    if test in ("true", "false"):
        if kind != "BOOLEAN":
            return None
        wanted = test == "true"
        return lambda v: v is wanted
    if test in ("like", "notlike"):
        if kind != "VARCHAR":
            return None
        pattern = re.compile("".join(".*" if c == "%" else "." if c == "_" else re.escape(c) for c in literal),
                             re.DOTALL)
        if test == "like":
            return lambda v: v is not None and pattern.fullmatch(v) is not None
        return lambda v: v is not None and pattern.fullmatch(v) is None
    what, text = literal
    if kind == "VARCHAR" and what == "str":
        value: Any = text
    elif kind == "BOOLEAN" and what == "bool":
        value = text
    elif kind in ("INTEGER", "BIGINT") and what == "num" and "." not in text:
        value = int(text)
    elif kind == "DOUBLE" and what == "num" and len(text.lstrip("-").replace(".", "")) <= 15:
        value = float(text)  # as DuckDB's cast of the literal: exact digits, one rounding
    else:
        return None
    compare = {"eq": lambda v: v == value, "ne": lambda v: v != value, "lt": lambda v: v < value,
               "le": lambda v: v <= value, "gt": lambda v: v > value, "ge": lambda v: v >= value}[test]
    return lambda v: v is not None and compare(v)


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
