"""Writing a query result to a file; the format follows the file's extension."""

import os
from typing import Any, List, Tuple

import click

from probe.cli.render import render_csv, render_json
from probe.client import Client
from probe.client.results import Rows
from probe.errors import UsageError

__all__ = ["FILE_FORMATS", "file_format", "check_writable", "write_rows", "write_arrow", "wrote"]

FILE_FORMATS = {".csv": "csv", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


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
    click.echo("wrote %d row%s to %s" % (count, "" if count == 1 else "s", path), err=True)
    if truncated:
        click.echo("probe: the result was truncated at the row cap: the file does not hold every row", err=True)


def write_rows(path: str, rows: Rows, fmt: str) -> None:
    text = render_json(rows) if fmt == "json" else render_csv(rows)
    try:
        with open(path, "w") as handle:
            handle.write(text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        raise _open_error(path, exc) from None


def write_arrow(path: str, parts: List[Tuple[Client, Any]], fmt: str, with_target: bool) -> int:
    """Write Arrow tables from one or more targets (a ``target`` column first when several)."""
    import pyarrow as pa

    tables = []
    for client, table in parts:
        if with_target:
            table = table.add_column(0, "target", pa.array([client.target.label] * table.num_rows, pa.string()))
        tables.append(table.replace_schema_metadata(None))
    truncated = any((t.schema.metadata or {}).get(b"probe.truncated") == b"true" for _, t in parts)
    combined = pa.concat_tables(tables) if tables else pa.table({})
    try:
        if fmt == "parquet":
            import pyarrow.parquet as pq

            pq.write_table(combined, path)
        else:
            with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, combined.schema) as writer:
                writer.write_table(combined)
    except OSError as exc:
        raise _open_error(path, exc) from None
    wrote(combined.num_rows, path, truncated)
    return combined.num_rows
