"""``probe TARGET query SQL``: run SQL against the target's tables."""

from typing import Any, List, Optional

from probe.cli.commands import made_on_first_use
from probe.cli.context import CliContext, each_target, report_failures, stop_where_unanswered, stopped_on_ranks
from probe.cli.output import check_writable, file_format, print_rows, say, write_rows, write_table, wrote
from probe.cli.render import render_rows, terminal_width, visible
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
    """The command (``probe.cli.fast`` calls it without click): the client plans the query once
    (``probe.client.query_plan``), fetches and combines; this shows the one result."""
    if max_memory is not None:
        from probe.client.local_sql import set_max_memory

        set_max_memory(max_memory)
    file_fmt = file_format(output) if output else None
    _refuse_conflicts(fmt, file_fmt, output, vertical, wide)
    if output:
        check_writable(output)
    fmt = "vertical" if vertical else fmt or "table"
    from probe.client import query_plan as planned

    plan = planned.plan_query(sql, cli.is_cluster, merge, file_fmt in ("parquet", "arrow"), max_rows, query_timeout,
                              native)
    cluster, footer = None, None
    if plan.over == planned.MEMBERS:  # the job's member list, queried here: no rank is asked
        cli.all_ranks = True
        result = planned.fetch_members(plan, cli.cluster())
    elif plan.over == planned.RANKS:
        cluster = cli.cluster()
        result = planned.combine_ranks(plan, _fetch_ranks(cluster, plan))
    else:
        result = _fetch_targets(cli, plan)
        if result is None:  # no target answered: the errors said why
            return
        if not plan.arrow and result.truncated:
            import shlex

            footer = truncation_note(result, max_rows, " ".join(shlex.quote(t) for t in cli.targets[:1]) or "TARGET")
    _show(result, fmt, wide, output, file_fmt, footer)
    if cluster is not None:
        for line in cluster.asked_directly:  # node helpers that could not gather (--via)
            say("probe: " + visible(line), err=True)
        stop_where_unanswered(cluster, "query", plan.query_id)  # after the output: the answers first
        report_failures(cli, cluster.failures, len(cluster.members))


def _fetch_ranks(cluster: Any, plan: Any) -> Any:
    """Every rank's answer; Ctrl-C stops the query on the ranks and says what became of it there."""
    from probe.client.query_plan import fetch_ranks

    try:
        fetched = fetch_ranks(plan, cluster)
    except KeyboardInterrupt:
        if cluster.progress is not None:
            cluster.progress(-1, 0, [])
        raise KeyboardInterrupt("interrupted (Ctrl-C); %s" % stopped_on_ranks(cluster, "query", plan.query_id)) from None
    if cluster.progress is not None:
        cluster.progress(-1, 0, [])
    return fetched


def _fetch_targets(cli: CliContext, plan: Any) -> Any:
    """Every target's answer (several at once), combined; None where none answered. Ctrl-C stops the query
    in the targets it was sent to."""
    from probe.client.query_plan import combine_targets, fetch_one

    running: List[Client] = []  # the clients whose query was sent, for Ctrl-C

    def tracked(client: Client) -> Any:
        running.append(client)
        return fetch_one(plan, client)

    try:
        answers = [(client.target.label, answer) for client, answer in each_target(cli, tracked)]
    except KeyboardInterrupt:
        raise KeyboardInterrupt("interrupted (Ctrl-C); %s" % _stop_in_target(running, plan.query_id)) from None
    return combine_targets(plan, answers, len(cli.targets) > 1) if answers else None


def _show(result: Any, fmt: str, wide: bool, output: Optional[str], file_fmt: Optional[str],
          footer: Optional[str]) -> None:
    """The one place a query's result leaves: a file, or the terminal (or pipe) in ``fmt``."""
    if file_fmt in ("parquet", "arrow"):
        write_table(output or "", result, file_fmt)
        return
    if output:
        write_rows(output, result, file_fmt or "csv")
        wrote(len(result.rows), output, result.truncated)
        return
    if result.columns or fmt != "table":  # no rank answered: nothing to tabulate, the failures say why
        print_rows(render_rows(result, fmt, terminal_width(), wide, footer), fmt)
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
