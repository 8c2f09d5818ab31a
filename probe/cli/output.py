"""Writing what a command prints (for a person, or exact for a script) and a query result to a file (its
format follows the file's extension).

Every string a target sends (a thread's name, a snippet's output, an agent's error) may hold terminal
escape sequences. What is printed for a person goes through :func:`say`, which shows control characters
as escapes (ESC as ``\\x1b``), on a terminal or not; what is printed for a script (JSON, CSV, a snippet's
own output) goes through :func:`emit`, exact when piped and made visible only on a terminal. JSON is
exact either way: ``json.dumps`` writes every control character as ``\\u001b``.
"""

import io
import os
import sys
from typing import Any, Optional

from probe.cli.render import render_csv, render_json, visible
from probe.client.results import Rows
from probe.errors import UsageError

__all__ = ["say", "emit", "echo", "chosen_format", "print_rows", "FILE_FORMATS", "file_format", "check_writable", "write_rows",
           "write_table", "wrote"]

FILE_FORMATS = {".csv": "csv", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def say(text: str = "", err: bool = False, nl: bool = True) -> None:
    """Print text for a person: control characters made visible (newlines and tabs kept)."""
    echo(visible(text, lines=True), err=err, nl=nl)


def emit(text: str, err: bool = False, nl: bool = True) -> None:
    """Print text for a script (JSON, CSV, a snippet's own output) exactly as it is, escape sequences
    included; on a terminal, where a person reads it, control characters are made visible as by :func:`say`."""
    stream = sys.stderr if err else sys.stdout
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):
        terminal = False
    # color=True: echo would otherwise strip what looks like a colour code from text that is not for a terminal
    echo(visible(text, lines=True) if terminal else text, err=err, nl=nl, color=True)


def echo(text: str = "", err: bool = False, nl: bool = True, color: Optional[bool] = None) -> None:
    """``click.echo(text, err=err, nl=nl, color=color)``, the same bytes, without importing click (the
    commands run in loops import no click, see ``probe.cli.fast``): on a plain text stream whose encoding
    is no ASCII, the text is written and flushed. Anything else goes to click itself: another stream (one
    a test captures, an ASCII one click writes as UTF-8), and an ESC in text that click may strip of
    colour codes (``color`` None, the stream no terminal)."""
    stream = sys.stderr if err else sys.stdout
    if stream is None:  # no standard stream at all: click prints nothing either
        return
    if (type(stream) is not io.TextIOWrapper or _ascii(stream.encoding)
            or (color is None and "\x1b" in text and not _isatty(stream))):
        import click

        click.echo(text, err=err, nl=nl, color=color)
        return
    out = text + "\n" if nl else text
    if out:
        stream.write(out)
    stream.flush()


def _ascii(encoding: Optional[str]) -> bool:
    import codecs

    try:
        return codecs.lookup(encoding or "ascii").name == "ascii"
    except LookupError:
        return False


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except Exception:
        return False


def chosen_format(given: Optional[str], older: Optional[str], as_json: bool) -> Optional[str]:
    """The output format asked for by ``-F/--format`` (``given``), ``-f`` (``older``) and ``--json``; None
    when none was. Two different ones are refused."""
    asked = [f for f in (given, older) if f is not None]
    if as_json:
        asked.append("json")
    if len(set(asked)) > 1:
        raise UsageError("two output formats were asked for: %s" % " and ".join(dict.fromkeys(asked)),
                         hint="give one: --json, or -F FORMAT")
    return asked[0] if asked else None


def print_rows(text: str, fmt: str) -> None:
    """Rendered rows: JSON and CSV are for scripts (exact), a table or records for a person."""
    (emit if fmt in ("json", "csv") else say)(text)


def file_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_FORMATS:
        raise UsageError("cannot tell the format of %s from its extension" % path,
                         hint="use one of %s" % ", ".join(FILE_FORMATS))
    return FILE_FORMATS[ext]


def check_writable(path: str) -> None:
    """Refuse an output path that cannot be written before anything is asked of the target."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError("cannot write %s: no directory %s" % (path, folder), hint="create it, or choose another -o")
    if os.path.isdir(path):
        raise UsageError("cannot write %s: it is a directory" % path, hint="give a file name, e.g. -o out.csv")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise UsageError("cannot write %s: permission denied" % path, hint="choose a path you may write")


def _open_error(path: str, exc: OSError) -> UsageError:
    return UsageError("cannot write %s: %s" % (path, exc.strerror or exc), hint="choose another -o path")


def wrote(count: int, path: str, truncated: bool) -> None:
    """The one line that says what went into the file, and whether the result was cut."""
    say("wrote %d row%s to %s" % (count, "" if count == 1 else "s", path), err=True)
    if truncated:
        say("probe: the result was truncated at the row cap: the file does not hold every row", err=True)


def write_rows(path: str, rows: Rows, fmt: str) -> None:
    text = render_json(rows) if fmt == "json" else render_csv(rows)
    try:
        with open(path, "w") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        raise _open_error(path, exc) from None


def write_table(path: str, table: Any, fmt: str) -> int:
    """Write one Arrow table (``probe.client.query_plan`` combined it) as a .parquet or .arrow file."""
    import pyarrow as pa

    truncated = (table.schema.metadata or {}).get(b"probe.truncated") == b"true"
    table = table.replace_schema_metadata(None)
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(table, path)
        else:
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
                writer.write_table(table)
    except OSError as exc:
        raise _open_error(path, exc) from None
    wrote(table.num_rows, path, truncated)
    return table.num_rows
