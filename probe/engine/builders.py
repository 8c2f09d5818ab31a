"""Functions that build one large value from a small call, checked before a query runs.

DuckDB's memory limit counts its own working memory, not the values a scalar function builds: one call
of ``range(200000000)`` built a list that took the process to 14 GB, and ``repeat('x', n)`` over a
vector of 2048 rows builds 2048 strings before anything can interrupt it (DuckDB checks for an
interrupt between vectors, and the agent's memory guard can only ask). So the calls that turn a small
number into a large value are looked at in the parsed query (DuckDB's own parser, through
``json_serialize_sql``): their size arguments must be constants, and the value they build must stay
under a bound that keeps a whole vector of such values within the agent's memory budget. Rows, not
values, are the way to make many things: ``FROM range(N)`` streams, and is not checked here.

Runs in the target; stdlib only (the caller gives the parsed tree as JSON text).
"""

import json
from typing import Any, Dict, Iterator, List, Optional

from probe.errors import TooLarge

__all__ = ["check_builders", "MAX_ELEMENTS", "MAX_BYTES"]

MAX_ELEMENTS = 8192
"""The most elements one call may put in a list (x 8 bytes x 2048 rows a vector: 128 MiB)."""
MAX_BYTES = 65536
"""The most characters one call may put in a string (x 2048 rows a vector: 128 MiB)."""
MAX_UNKNOWN_REPEAT = 64
"""``repeat`` of a value that is not a constant: at most this many copies."""

_RANGES = {"range", "generate_series"}
_PADS = {"lpad", "rpad"}
_RESIZES = {"list_resize", "array_resize"}
_FORMATS = {"printf", "format"}
BUILDERS = _RANGES | _PADS | _RESIZES | _FORMATS | {"repeat", "bar"}


def check_builders(serialized: str) -> None:
    """Raise :class:`TooLarge` for a call that may build a value past the bounds; ``serialized`` is
    ``json_serialize_sql``'s answer for the query. A tree that cannot be read is let through: the memory
    guard still watches the query."""
    try:
        tree = json.loads(serialized)
    except ValueError:
        return
    if not isinstance(tree, dict) or tree.get("error"):
        return
    for call in _scalar_calls(tree.get("statements"), in_table_function=False):
        _check_call(call)


def _scalar_calls(node: Any, in_table_function: bool) -> Iterator[Dict[str, Any]]:
    """Every function call of the tree that computes a value (a table function's own call is skipped:
    ``FROM range(N)`` makes rows, one vector at a time; its arguments are still walked)."""
    stack = [(node, in_table_function)]
    while stack:
        item, skip = stack.pop()
        if isinstance(item, list):
            stack.extend((x, False) for x in item)
        elif isinstance(item, dict):
            if item.get("class") == "FUNCTION" and not skip:
                yield item
            for key, value in item.items():
                # A table function's call sits under "function" of a TABLE_FUNCTION node.
                stack.append((value, key == "function" and item.get("type") == "TABLE_FUNCTION"))


def _check_call(call: Dict[str, Any]) -> None:
    name = str(call.get("function_name", "")).lower()
    if name not in BUILDERS:
        return
    args = [a.get("expression") if isinstance(a, dict) and "expression" in a else a
            for a in call.get("arguments") or []]
    if name in _RANGES:
        _check_range(name, args)
    elif name == "repeat":
        _check_repeat(args)
    elif name in _PADS:
        _bounded(name, _int(args, 1), MAX_BYTES, "its width")
    elif name in _RESIZES:
        _bounded(name, _int(args, 1), MAX_ELEMENTS, "its size")
    elif name == "bar":
        if len(args) >= 4:
            _bounded(name, _int(args, 3), MAX_BYTES, "its width")
    elif name in _FORMATS:
        _check_format(name, args)


def _check_range(name: str, args: List[Any]) -> None:
    numbers = [_int(args, i) for i in range(len(args))]
    if not args or len(args) > 3 or any(n is None for n in numbers):
        raise _refused(name, "as a value, %s() takes whole-number constants here (it builds one list of all its "
                             "elements)" % name)
    if len(numbers) == 1:
        start, stop, step = 0, numbers[0], 1
    else:
        start, stop, step = numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else 1
    assert start is not None and stop is not None and step is not None
    count = 0 if step == 0 else max(0, (stop - start + step - (1 if step > 0 else -1)) // step)
    if step == 0 or count > MAX_ELEMENTS:
        raise _refused(name, "%s(...) would build one list of %s elements, more than the %s one value may hold here"
                       % (name, "endless" if step == 0 else "{:,}".format(count), "{:,}".format(MAX_ELEMENTS)))


def _check_repeat(args: List[Any]) -> None:
    times = _int(args, 1)
    if times is None:
        raise _refused("repeat", "repeat()'s count must be a whole-number constant here")
    text = _constant(args[0]) if args else None
    if isinstance(text, str):
        size, limit, unit = len(text) * times, MAX_BYTES, "characters"
    elif isinstance(text, list):
        size, limit, unit = len(text) * times, MAX_ELEMENTS, "elements"
    else:
        size, limit, unit = times, MAX_UNKNOWN_REPEAT, "copies of a value that is not a constant"
    if size > limit:
        raise _refused("repeat", "repeat(...) would build a value of {:,} {}, more than the {:,} allowed here".format(
            size, unit, limit))


def _check_format(name: str, args: List[Any]) -> None:
    pattern = _constant(args[0]) if args else None
    if not isinstance(pattern, str):
        raise _refused(name, "%s()'s format must be a constant here" % name)
    digits = 0
    for char in pattern:
        digits = digits + 1 if char.isdigit() else 0
        if char == "*" or digits > 5:
            raise _refused(name, "%s() with a width of * or of more than 5 digits is not run here" % name)


def _bounded(name: str, value: Optional[int], limit: int, what: str) -> None:
    if value is None:
        raise _refused(name, "%s()'s %s must be a whole-number constant here" % (name, what.split()[-1]))
    if value > limit:
        raise _refused(name, "%s(...) with %s %s would build a value past the %s allowed here"
                       % (name, what, "{:,}".format(value), "{:,}".format(limit)))


def _int(args: List[Any], index: int) -> Optional[int]:
    value = _constant(args[index]) if index < len(args) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _constant(expression: Any) -> Any:
    """The value of a constant expression: a number or string literal, a negated number, a list of
    constants; None for anything else (a column, a call, a parameter)."""
    if not isinstance(expression, dict):
        return None
    if expression.get("class") == "CONSTANT":
        literal = expression.get("literal") or {}
        kind, text = literal.get("kind"), literal.get("text")
        if kind in ("INTEGER", "BIGINT", "HUGEINT", "SMALLINT", "TINYINT", "UBIGINT", "UINTEGER", "DECIMAL") \
                and isinstance(text, str):
            try:
                number = float(text)
            except ValueError:
                return None
            return int(number) if number == int(number) else None
        if kind == "STRING" and isinstance(text, str):
            return text
        return None
    if expression.get("class") == "FUNCTION" and expression.get("function_name") == "-" \
            and len(expression.get("arguments") or []) == 1:
        inner = _constant((expression["arguments"][0] or {}).get("expression"))
        return -inner if isinstance(inner, int) else None
    if expression.get("class") == "FUNCTION" and expression.get("function_name") == "list_value":
        items = [_constant((a or {}).get("expression")) for a in expression.get("arguments") or []]
        return items if all(i is not None for i in items) else None
    return None


def _refused(name: str, why: str) -> TooLarge:
    return TooLarge("%s: a single value built that large could exhaust the target's memory before anything can "
                    "stop it" % why,
                    hint="make rows instead of one big value (SELECT ... FROM range(N) streams), or smaller values")
