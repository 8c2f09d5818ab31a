"""Presentation as pure functions: data in, text out. Only the commands write to the terminal."""

import io
import json
import math
from typing import Any, Dict, Iterable, Iterator, List, Optional

from probe.cli.render_stack import _pattern, render_backtrace, visible  # noqa: F401 (re-exported)
from probe.client.results import EvalResult, Rows, TableInfo

__all__ = ["visible", "render_rows", "render_table", "render_vertical", "fit_widths", "text_width", "terminal_width", "plain",
           "render_json", "render_csv", "render_backtrace", "render_tables",
           "render_schema", "render_eval", "render_unavailable", "FORMATS"]

FORMATS = ("table", "json", "csv")
_MAX_CELL = 80  # a cell's width when the table is not fitted to a terminal (output piped)
_MIN_COLUMN = 6  # a column is never fitted narrower than this (or its header, if shorter)


def text_width(text: str) -> int:
    """Columns ``text`` takes on a terminal: East-Asian wide and full-width characters take two."""
    if text.isascii():
        return len(text)
    import unicodedata

    return sum(0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def _cut(text: str, width: int) -> str:
    """``text`` cut to ``width`` terminal columns, ending in an ellipsis when anything was dropped."""
    if text_width(text) <= width:
        return text
    out, used = [], 0
    for char in text:
        w = text_width(char)
        if used + w > width - 1:
            break
        out.append(char)
        used += w
    return "".join(out) + "…"


def _pad(text: str, width: int) -> str:
    return text + " " * (width - text_width(text))


def _interval(value: Any) -> str:
    """DuckDB's text for an INTERVAL sent as [months, days, nanoseconds]."""
    months, days, nanos = (int(v) for v in value)
    parts = []
    if months:
        years, months = divmod(months, 12)
        parts += ["%d year%s" % (years, "" if years == 1 else "s")] if years else []
        parts += ["%d month%s" % (months, "" if months == 1 else "s")] if months else []
    if days:
        parts.append("%d day%s" % (days, "" if days == 1 else "s"))
    if nanos or not parts:
        sign = "-" if nanos < 0 else ""
        seconds, rest = divmod(abs(nanos), 10 ** 9)
        minutes, seconds = divmod(seconds, 60)
        hours, minutes = divmod(minutes, 60)
        clock = "%s%02d:%02d:%02d" % (sign, hours, minutes, seconds)
        parts.append(clock + (".%06d" % (rest // 1000) if rest else ""))
    return " ".join(parts)


def _blob(value: bytes) -> str:
    """DuckDB's text for a BLOB: printable ASCII as is, every other byte as \\xNN."""
    return "".join(chr(b) if 32 <= b < 127 and b != 92 else "\\x%02X" % b for b in value)


def plain(value: Any, sql_type: str = "") -> Any:
    """A value as text-friendly Python: intervals and blobs as DuckDB writes them, the rest unchanged."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _blob(bytes(value))
    if "interval" in sql_type.lower() and isinstance(value, (list, tuple)) and len(value) == 3:
        return _interval(value)
    if type(value).__name__ == "MonthDayNano":
        return _interval(tuple(value))
    return value


def _cell(value: Any, sql_type: str = "", whole: bool = False) -> str:
    value = plain(value, sql_type)
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return "%.6g" % value
    return visible(str(value), lines=whole)


def fit_widths(natural: List[int], headers: List[int], width: int) -> List[int]:
    """Column widths that fit ``width`` terminal columns (two spaces between columns): the widest column
    gives way first, none below its header or ``_MIN_COLUMN``; may stay wider when even that cannot fit."""
    widths = list(natural)
    floor = _floors(natural, headers)
    budget = width - 2 * max(len(widths) - 1, 0)
    while sum(widths) > budget:
        widest = max(range(len(widths)), key=lambda i: widths[i] - floor[i])
        over = widths[widest] - floor[widest]
        if over <= 0:
            break
        others = sorted((w for i, w in enumerate(widths) if i != widest), reverse=True)
        step = max(1, min(over, sum(widths) - budget, widths[widest] - (others[0] if others else 0) or 1))
        widths[widest] -= step
    return widths


def _floors(natural: List[int], headers: List[int]) -> List[int]:
    """The narrowest each column is fitted to: its header up to 10 columns, never below ``_MIN_COLUMN``."""
    return [min(n, max(min(h, 10), _MIN_COLUMN)) for n, h in zip(natural, headers)]


def fits(rows: Rows, width: int) -> bool:
    """Whether the table can be fitted into ``width`` columns without cutting columns below their floor."""
    names = [visible(n) for n in rows.column_names]
    types = [t for _, t in rows.columns]
    natural = [text_width(n) for n in names]
    for row in rows.rows:
        for i, value in enumerate(row):
            natural[i] = max(natural[i], text_width(_cell(value, types[i] if i < len(types) else "")))
    return sum(_floors(natural, [text_width(n) for n in names])) + 2 * max(len(names) - 1, 0) <= width


def render_table(rows: Rows, width: Optional[int] = None, wide: bool = False,
                 footer: Optional[str] = None) -> Iterator[str]:
    """A text table, then a line that counts the rows.

    ``width``: the terminal's columns; the table is fitted to it, the widest columns cut first. Without
    it (output piped) cells are cut at 80 characters. ``wide``: nothing is cut. A cut cell ends in an
    ellipsis, and the count line says how to see it whole.
    """
    names = [visible(n) for n in rows.column_names]
    types = [t for _, t in rows.columns]
    cells = [[_cell(v, types[i] if i < len(types) else "") for i, v in enumerate(row)] for row in rows.rows]
    natural = [text_width(n) for n in names]
    for row in cells:
        for i, text in enumerate(row):
            natural[i] = max(natural[i], text_width(text))
    if wide:
        widths = natural
    elif width:
        widths = fit_widths(natural, [text_width(n) for n in names], width)
    else:
        widths = [min(w, _MAX_CELL) for w in natural]
    cut = widths != natural
    yield "  ".join(_pad(_cut(n, w), w) for n, w in zip(names, widths)).rstrip()
    yield "  ".join("-" * w for w in widths)
    for row in cells:
        yield "  ".join(_pad(_cut(t, w), w) for t, w in zip(row, widths)).rstrip()
    count = "(%d row%s)" % (len(rows.rows), "" if len(rows.rows) == 1 else "s")
    notes = ([footer] if footer else []) + (["cells cut to fit; -x or --wide shows them whole"] if cut else [])
    line = " -- ".join([count] + notes)
    if width and not wide and text_width(line) > width:  # past the terminal's edge: a line each
        yield from [count] + notes
    else:
        yield line


def render_vertical(rows: Rows, footer: Optional[str] = None, width: Optional[int] = None) -> Iterator[str]:
    """One record per block, one column per line, values whole (psql's \\x, DuckDB's .mode line); with a
    terminal ``width``, a long value wraps onto lines of its own rather than past the edge."""
    names = [visible(n) for n in rows.column_names]
    types = [t for _, t in rows.columns]
    name_w = max((text_width(n) for n in names), default=0)
    for number, row in enumerate(rows.rows, 1):
        yield "-[ RECORD %d ]%s" % (number, "-" * max(name_w - 8, 4))
        for i, value in enumerate(row):
            lines = _wrap(_cell(value, types[i] if i < len(types) else "", whole=True).split("\n"),
                          width - name_w - 3 if width else 0)
            yield ("%s | %s" % (_pad(names[i], name_w), lines[0])).rstrip()
            for more in lines[1:]:
                yield ("%s | %s" % (" " * name_w, more)).rstrip()
    count = "(%d row%s)" % (len(rows.rows), "" if len(rows.rows) == 1 else "s")
    yield count + (" -- " + footer if footer else "")


def _wrap(lines: List[str], width: int) -> List[str]:
    """Each line cut into pieces of at most ``width`` terminal columns (none when ``width`` < 10)."""
    if width < 10:
        return lines or [""]
    out: List[str] = []
    for line in lines:
        piece, used = "", 0
        for char in line:
            w = text_width(char)
            if used + w > width:
                out.append(piece)
                piece, used = "", 0
            piece += char
            used += w
        out.append(piece)
    return out or [""]


def _jsonable(value: Any, sql_type: str = "") -> Any:
    value = plain(value, sql_type)
    if isinstance(value, float) and not math.isfinite(value):
        return None  # NaN and infinities have no JSON spelling; JSON.stringify writes null too
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def render_json(rows: Rows) -> str:
    """The rows as a JSON array of objects: exactly the rows the table view shows; valid JSON always
    (NaN and infinities become null)."""
    types = [t for _, t in rows.columns]
    names = rows.column_names
    return json.dumps([{n: _jsonable(v, t) for n, t, v in zip(names, types, row)} for row in rows.rows],
                      indent=None, allow_nan=False)


def render_csv(rows: Rows) -> str:
    out = io.StringIO()
    import csv  # here: only CSV output needs it

    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(rows.column_names)
    types = [t for _, t in rows.columns]
    for row in rows.rows:
        writer.writerow(["" if v is None else plain(v, t) for v, t in zip(row, types)])
    return out.getvalue()


def render_rows(rows: Rows, fmt: str, width: Optional[int] = None, wide: bool = False,
                footer: Optional[str] = None) -> str:
    if fmt == "json":
        return render_json(rows)
    if fmt == "csv":
        return render_csv(rows).rstrip("\n")
    if fmt == "vertical":
        return "\n".join(render_vertical(rows, footer, width))
    if width and not wide and rows.rows and not fits(rows, width):  # psql's \x auto: records, one column a line
        note = "one column per line (too wide for the terminal; --wide: a table)"
        return "\n".join(render_vertical(rows, "%s -- %s" % (footer, note) if footer else note, width))
    return "\n".join(render_table(rows, width, wide, footer))


def terminal_width() -> Optional[int]:
    """Columns to fit a table to: $COLUMNS when set, else the terminal's on a terminal, else None (piped)."""
    import os
    import sys

    raw = os.environ.get("COLUMNS", "")
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns if sys.stdout.isatty() else None
    except (OSError, ValueError, AttributeError):
        return None


_STATE_WORDS = {"gil_held": "alive", "no_answer": "alive", "stopped": "stopped", "dead": "dead",
                "core file": "a core file"}


def render_unavailable(label: str, info: Dict[str, Any]) -> str:
    """``health`` of a target whose agent cannot answer: its state, and who holds the GIL."""
    state = _STATE_WORDS.get(str(info.get("state")), str(info.get("state")))
    agent = "agent %s" % info.get("agent")
    if info.get("agent_silent_s") is not None and info.get("state") in ("gil_held", "stopped", "no_answer"):
        agent += " since %s (%s s)" % (info.get("agent_last_ran"), info["agent_silent_s"])
    parts = ["%s: pid %s, %s, %s" % (label, info.get("pid"), state, agent)]
    holder = info.get("gil_holder")
    if holder:
        parts.append("GIL held by thread %s%s in %s" % (holder.get("native_id"),
                                                        ' "%s"' % holder["thread_name"] if holder.get("thread_name")
                                                        else "", holder.get("where")))
    if info.get("cause"):
        parts.append("cause: %s" % info["cause"])
    if info.get("signal"):
        parts.append("signal: %s" % info["signal"])
    why = str(info.get("why")) + (" -- %s" % info["hint"] if info.get("hint") else "")
    return visible("; ".join(parts)) + "\n  " + visible(why)


def render_tables(tables: Iterable[TableInfo]) -> Iterator[str]:
    items = [(visible(t.name), visible(t.description)) for t in tables]
    width = max((text_width(name) for name, _ in items), default=0)
    for name, description in items:
        yield "%s  %s" % (_pad(name, width), description)


def render_schema(table: TableInfo) -> Iterator[str]:
    """A table's spec for a person (a user's own table may name itself and its columns as it likes)."""
    yield "%s: %s" % (visible(table.name), visible(table.description))
    yield ""
    columns = [(visible(c.name), visible(c.type), visible(c.description)) for c in table.columns]
    name_w = max((text_width(c[0]) for c in columns), default=0)
    type_w = max((text_width(c[1]) for c in columns), default=0)
    for name, sql_type, description in columns:
        yield "  %s  %s  %s" % (_pad(name, name_w), _pad(sql_type, type_w), description)
    if table.example:
        yield ""
        yield "Example: %s" % visible(table.example)


def render_eval(result: EvalResult) -> Dict[str, str]:
    """What goes to stdout and to stderr, as a REPL would show it."""
    out = result.stdout
    if result.value is not None:
        out += result.value + "\n"
    err = result.stderr + (result.error or "")
    return {"stdout": out, "stderr": err}
