"""Presentation as pure functions: data in, text out. Only the commands write to the terminal."""

import csv
import io
import json
from typing import Any, Dict, Iterable, Iterator, List, Sequence

from probe.client.results import EvalResult, Frame, Rows, TableInfo

__all__ = ["render_rows", "render_table", "render_json", "render_csv", "render_backtrace", "render_tables",
           "render_schema", "render_eval", "render_unavailable", "FORMATS"]

FORMATS = ("table", "json", "csv")
_MAX_CELL = 80


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return "%.6g" % value
    text = str(value).replace("\n", "\\n")
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 1] + "…"


def render_table(rows: Rows) -> Iterator[str]:
    """A fixed-width text table, then a line that counts the rows (and says if they were cut)."""
    names = rows.column_names
    cells = [[_cell(v) for v in row] for row in rows.rows]
    widths = [len(n) for n in names]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    yield "  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip()
    yield "  ".join("-" * w for w in widths)
    for row in cells:
        yield "  ".join(t.ljust(w) for t, w in zip(row, widths)).rstrip()
    count = "(%d row%s)" % (len(rows.rows), "" if len(rows.rows) == 1 else "s")
    if rows.truncated:
        count += " -- truncated at the row cap; narrow the query or raise --max-rows"
    yield count


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def render_json(rows: Rows) -> str:
    """The rows as a JSON array of objects: exactly the rows the table view shows."""
    return json.dumps([{k: _jsonable(v) for k, v in r.items()} for r in rows.as_dicts()], indent=None)


def render_csv(rows: Rows) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(rows.column_names)
    for row in rows.rows:
        writer.writerow(["" if v is None else v for v in row])
    return out.getvalue()


def render_rows(rows: Rows, fmt: str) -> str:
    if fmt == "json":
        return render_json(rows)
    if fmt == "csv":
        return render_csv(rows).rstrip("\n")
    return "\n".join(render_table(rows))


def render_backtrace(frames: Sequence[Frame]) -> Iterator[str]:
    """One block per thread (main thread first), innermost frame first, with the source line."""
    threads: Dict[int, List[Frame]] = {}
    for frame in frames:
        threads.setdefault(frame.thread_id, []).append(frame)
    order = sorted(threads.values(), key=lambda fs: (not fs[0].is_main, fs[0].thread_name or "", fs[0].thread_id))
    for i, stack in enumerate(order):
        first = stack[0]
        if i:
            yield ""
        tags = ["native %s" % first.native_id] if first.native_id is not None else []
        if first.is_main:
            tags.append("main")
        yield 'Thread %d "%s"%s' % (first.thread_id, first.thread_name or "?", " (%s)" % ", ".join(tags) if tags else "")
        for frame in sorted(stack, key=lambda f: f.depth):
            if frame.frame_type == "native":
                where = "%s:%d" % (frame.file, frame.lineno) if frame.lineno else frame.file
                yield "    [C] %s (%s)" % (frame.func, where)
                continue
            yield "    %s (%s:%d)" % (frame.func, frame.file, frame.lineno)
            if frame.code:
                yield "        %s" % frame.code


def render_unavailable(label: str, info: Dict[str, Any]) -> str:
    """``health`` of a target whose agent cannot answer: its state, and who holds the GIL."""
    parts = ["%s: pid %s, %s; agent %s" % (label, info.get("pid"), info.get("state"), info.get("agent"))]
    if info.get("agent_silent_s") is not None:
        parts.append("last ran %s s ago (%s)" % (info["agent_silent_s"], info.get("agent_last_ran")))
    holder = info.get("gil_holder")
    if holder:
        parts.append("GIL held by thread %s%s in %s" % (holder.get("native_id"),
                                                        ' "%s"' % holder["thread_name"] if holder.get("thread_name")
                                                        else "", holder.get("where")))
    if info.get("cause"):
        parts.append("cause: %s" % info["cause"])
    if info.get("signal"):
        parts.append("signal: %s" % info["signal"])
    return "; ".join(parts) + "\n  " + str(info.get("why")) + (" -- %s" % info["hint"] if info.get("hint") else "")


def render_tables(tables: Iterable[TableInfo]) -> Iterator[str]:
    items = list(tables)
    width = max((len(t.name) for t in items), default=0)
    for table in items:
        yield "%s  %s" % (table.name.ljust(width), table.description)


def render_schema(table: TableInfo) -> Iterator[str]:
    yield "%s: %s" % (table.name, table.description)
    yield ""
    name_w = max(len(c.name) for c in table.columns)
    type_w = max(len(c.type) for c in table.columns)
    for column in table.columns:
        yield "  %s  %s  %s" % (column.name.ljust(name_w), column.type.ljust(type_w), column.description)
    if table.example:
        yield ""
        yield "Example: %s" % table.example


def render_eval(result: EvalResult) -> Dict[str, str]:
    """What goes to stdout and to stderr, as a REPL would show it."""
    out = result.stdout
    if result.value is not None:
        out += result.value + "\n"
    err = result.stderr + (result.error or "")
    return {"stdout": out, "stderr": err}
