"""Writing a query result to a file; the format follows the file's extension."""

import os
from typing import Any, List, Tuple

import click

from probe.cli.render import render_csv, render_json
from probe.client import Client
from probe.client.results import Rows
from probe.errors import UsageError

__all__ = ["FILE_FORMATS", "file_format", "write_rows", "write_arrow"]

FILE_FORMATS = {".csv": "csv", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def file_format(path: str) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext not in FILE_FORMATS:
        raise UsageError("cannot tell the format of %s from its extension" % path,
                         hint="use one of %s" % ", ".join(FILE_FORMATS))
    return FILE_FORMATS[ext]


def write_rows(path: str, rows: Rows, fmt: str) -> None:
    text = render_json(rows) if fmt == "json" else render_csv(rows)
    with open(path, "w") as handle:
        handle.write(text if text.endswith("\n") else text + "\n")


def write_arrow(path: str, parts: List[Tuple[Client, Any]], fmt: str, with_target: bool) -> int:
    """Write Arrow tables from one or more targets (a ``target`` column first when several)."""
    import pyarrow as pa

    tables = []
    for client, table in parts:
        if with_target:
            table = table.add_column(0, "target", pa.array([client.target.label] * table.num_rows, pa.string()))
        tables.append(table.replace_schema_metadata(None))
    combined = pa.concat_tables(tables) if tables else pa.table({})
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(combined, path)
    else:
        with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, combined.schema) as writer:
            writer.write_table(combined)
    click.echo("wrote %d rows to %s" % (combined.num_rows, path), err=True)
    return combined.num_rows
