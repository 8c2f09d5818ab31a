"""``probe TARGET query SQL``: run SQL against the target's tables."""

import os
from typing import Any, Callable, List, Optional

from probe.cli.commands import made_on_first_use
from probe.cli.context import CliContext, each_target
from probe.cli.output import check_writable, file_format, print_rows, say, write_arrow, write_rows, wrote
from probe.cli.render import render_rows, terminal_width
from probe.cli.spec import ARGUMENT, PATH, STRING, TABLE_FORMATS, Param, converted, count, output_params, seconds
from probe.client import Client
from probe.client.results import Rows
from probe.errors import ProbeError, UsageError


def _command() -> Any:
    import click

    from probe.cli.context import pass_cli
    from probe.cli.options import with_params

    @click.command("query")
    @with_params(PARAMS)
    @pass_cli
    def query(cli: CliContext, sql: str, fmt: Optional[str], vertical: bool, wide: bool, output: Optional[str],
              max_rows: Optional[int], query_timeout: Optional[float], max_memory: Optional[int], native: bool,
              merge: Optional[str] = None) -> None:
        """Run one SELECT statement. Tables: see `probe TARGET tables`.

        \b
        When the agent cannot answer (GIL held, stopped, dead) or TARGET is core:PATH, SQL over
        python.backtrace still runs, here, on the stacks read from outside; stderr says so.

        \b
        On a terminal the table is fitted to its width, the widest columns cut first (a cut cell ends
        in "…"); -x prints one column per line with every value whole; --wide cuts nothing.
        """
        run(cli, sql, fmt, vertical, wide, output, max_rows, query_timeout, native, merge, max_memory)

    return query


MIN_MEMORY = 64 << 20
"""The least ``--max-memory`` takes: DuckDB and pyarrow need some tens of MB before a query's own."""


def memory_size(text: str) -> int:
    """``--max-memory``'s value in bytes (``512MB``, ``2GiB``, a plain number of bytes); ValueError if it is
    no size, or less than ``MIN_MEMORY``, or past 1 TiB."""
    from probe.engine.memory import parse_size

    size = parse_size(text)
    if size is None or not MIN_MEMORY <= size <= 1 << 40:
        raise ValueError(text)
    return size


PARAMS = [
    Param(dest="sql", kind=ARGUMENT),
    *output_params(*TABLE_FORMATS, json_help="NaN and infinities are null in JSON", older_f=True),
    Param("-x", "--vertical", dest="vertical",
          help="One column per line, each record in its block, values whole (psql's \\x)."),
    Param("--wide", dest="wide", help="Cut no cell and do not fit the table to the terminal (pipe it to `less -S`)."),
    Param("-o", "--output", dest="output", kind=PATH,
          help="Write the result to a file instead: .csv, .json, .parquet or .arrow (by its extension)."),
    Param("--max-rows", dest="max_rows", kind=count(0), help="Return at most this many rows."),
    Param("--query-timeout", dest="query_timeout", kind=seconds(0.001), help="Seconds the query may run in the agent."),
    Param("--max-memory", dest="max_memory", kind=converted(memory_size, "%r is not a size from 64MiB to 1TiB (512MB, "
                                                                         "2GiB, ...)"), metavar="SIZE",
          help="Memory the query may take where it runs here, over the rows the agent sent (DuckDB in a worker "
               "process, its address space bounded by the kernel): 512MB, 2GiB... Default 1GiB."),
    Param("--native", dest="native",
          help="Run here over python.backtrace read from outside, C frames included (frame_type = 'native')."),
    Param("--merge", dest="merge", kind=STRING, metavar="SQL",
          help="Across ranks: run SQL here (DuckDB) over the union of every rank's rows, the table `result`."),
]
"""The command's options, which click and ``probe.cli.fast`` both read (``probe.cli.spec``)."""


__getattr__ = made_on_first_use("query", _command)


def run(cli: CliContext, sql: str, fmt: Optional[str] = None, vertical: bool = False, wide: bool = False,
        output: Optional[str] = None, max_rows: Optional[int] = None, query_timeout: Optional[float] = None,
        native: bool = False, merge: Optional[str] = None, max_memory: Optional[int] = None) -> None:
    """The command (``probe.cli.fast`` calls it without click)."""
    if max_memory is not None:
        from probe.client.local_sql import set_max_memory

        set_max_memory(max_memory)
    file_fmt = file_format(output) if output else None
    _refuse_conflicts(fmt, file_fmt, output, vertical, wide)
    if output:
        check_writable(output)
    fmt = "vertical" if vertical else fmt or "table"
    from probe.client.local_sql import names_members

    if names_members(sql):
        from probe.cli.query_ranks import query_members

        query_members(cli, sql, fmt, wide, output, file_fmt, max_rows, query_timeout, merge)
        return
    if cli.is_cluster:
        from probe.cli.query_ranks import query_across_ranks

        query_across_ranks(cli, sql, fmt, wide, output, file_fmt, max_rows, query_timeout, merge)
        return
    if merge:
        raise UsageError("--merge runs over the rows of several ranks", hint="add --all-ranks or --ranks LIST")
    several = len(cli.targets) > 1
    query_id = os.urandom(8).hex()  # as secrets.token_hex(8), without the hashlib that secrets imports
    running: List[Client] = []  # the clients whose query was sent (several targets run at once), for Ctrl-C

    def tracked(work: Callable[[Client], Any]) -> Callable[[Client], Any]:
        def run(client: Client) -> Any:
            running.append(client)
            return work(client)
        return run

    try:
        if file_fmt in ("parquet", "arrow"):
            tables = list(each_target(cli, tracked(lambda c: c.query(sql, max_rows=max_rows, timeout=query_timeout,
                                                                     native=native, query_id=query_id))))
            if tables:
                write_arrow(output or "", tables, file_fmt, several)
            return
        parts: List[Rows] = []
        for client, rows in each_target(cli, tracked(lambda c: c.query_rows(sql, max_rows=max_rows,
                                                                            timeout=query_timeout, native=native,
                                                                            query_id=query_id))):
            parts.append(rows.with_column("target", client.target.label) if several else rows)
    except KeyboardInterrupt:
        raise KeyboardInterrupt("interrupted (Ctrl-C); %s" % _stop_in_target(running, query_id)) from None
    if not parts:
        return
    combined = Rows.concat(parts)
    if output:
        write_rows(output, combined, file_fmt or "csv")
        wrote(len(combined.rows), output, combined.truncated)
        return
    footer = None
    if combined.truncated:
        import shlex

        footer = truncation_note(combined, max_rows, " ".join(shlex.quote(t) for t in cli.targets[:1]) or "TARGET")
    print_rows(render_rows(combined, fmt, terminal_width(), wide, footer), fmt)
    if footer and fmt in ("json", "csv"):
        say("probe: " + footer, err=True)


def _stop_in_target(running: List[Client], query_id: str) -> str:
    """Ask each agent to stop the query in flight; what became of them, in words (each outcome once)."""
    if not running:
        return "nothing was sent"
    return "; ".join(dict.fromkeys(_stop_one(client, query_id) for client in running))


def _stop_one(client: Client, query_id: str) -> str:
    try:
        state = client.interrupt_query(query_id)
    except ProbeError as exc:
        return "the query may still run in the target until its time limit (%s)" % exc.message
    return {"interrupted": "the query was stopped in the target", "cancelled": "the query was stopped in the target",
            "finished": "the query had already ended"}.get(state, "the query may still run in the target")


def truncation_note(rows: Rows, asked: Optional[int], target: str = "TARGET") -> str:
    """What cut the result, and a way to get more that can work (``target``: as the user wrote it)."""
    shown = len(rows.rows)
    if asked is not None and asked <= shown:
        return "cut at --max-rows %d; raise it, or narrow the query" % asked
    return "cut at %d rows, the agent's row cap; ask for more with --max-rows (up to the agent's ceiling, " \
           "see `probe %s health`), or narrow the query" % (shown, target)


def _refuse_conflicts(fmt: Optional[str], file_fmt: Optional[str], output: Optional[str], vertical: bool,
                      wide: bool) -> None:
    """Options that contradict each other are refused, never silently resolved."""
    if output and fmt and fmt != file_fmt:
        raise UsageError("-F %s contradicts -o %s, whose extension says %s" % (fmt, output, file_fmt),
                         hint="drop -F: a file's format follows its extension")
    if output and (vertical or wide):
        raise UsageError("%s shapes what is printed, and -o writes a file" % ("-x" if vertical else "--wide"),
                         hint="drop one of them")
    if vertical and fmt and fmt != "table":
        raise UsageError("-x prints records one column per line; it cannot be combined with -F %s" % fmt,
                         hint="drop -x or -F")
