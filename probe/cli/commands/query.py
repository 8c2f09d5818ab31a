"""``probe TARGET query SQL``: run SQL against the target's tables."""

from typing import List, Optional

import click

from probe.cli.context import CliContext, each_target, pass_cli
from probe.cli.output import file_format, write_arrow, write_rows
from probe.cli.render import FORMATS, render_rows
from probe.client.results import Rows


@click.command("query")
@click.argument("sql")
@click.option("-f", "--format", "fmt", type=click.Choice(FORMATS), default="table", show_default=True,
              help="How to print the result.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True),
              help="Write the result to a file instead: .csv, .json, .parquet or .arrow.")
@click.option("--max-rows", type=click.IntRange(min=0), help="Return at most this many rows.")
@click.option("--query-timeout", type=click.FloatRange(min=0.001), help="Seconds the query may run in the agent.")
@click.option("--native", is_flag=True,
              help="Run here over python.backtrace read from outside, C frames included (frame_type = 'native').")
@pass_cli
def query(cli: CliContext, sql: str, fmt: str, output: Optional[str], max_rows: Optional[int],
          query_timeout: Optional[float], native: bool) -> None:
    """Run one SELECT statement. Tables: see `probe TARGET tables`.

    \b
    When the agent cannot answer (GIL held, stopped, dead) or TARGET is core:PATH, SQL over
    python.backtrace still runs, here, on the stacks read from outside; stderr says so.
    """
    file_fmt = file_format(output) if output else None
    several = len(cli.targets) > 1
    if file_fmt in ("parquet", "arrow"):
        tables = list(each_target(cli, lambda c: c.query(sql, max_rows=max_rows, timeout=query_timeout, native=native)))
        if tables:
            write_arrow(output or "", tables, file_fmt, several)
        return
    parts: List[Rows] = []
    for client, rows in each_target(cli, lambda c: c.query_rows(sql, max_rows=max_rows, timeout=query_timeout,
                                                                native=native)):
        parts.append(rows.with_column("target", client.target.label) if several else rows)
    if not parts:
        return
    combined = Rows.concat(parts)
    if output:
        write_rows(output, combined, file_fmt or "csv")
        click.echo("wrote %d rows to %s" % (len(combined.rows), output), err=True)
    else:
        click.echo(render_rows(combined, fmt))
    if combined.truncated and fmt != "table":
        click.echo("probe: the result was truncated at the row cap", err=True)
