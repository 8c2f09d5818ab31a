"""``probe MASTER:PORT --all-ranks query SQL [--merge SQL]``: a row per rank's row, ``rank`` and ``host``
first; ``--merge`` queries their union here. ``probe MASTER:PORT query "... FROM cluster.ranks"``: the
member list, queried here."""

import secrets
from typing import Any, Optional

from probe.cli.context import CliContext, report_failures, stop_where_unanswered, stopped_on_ranks
from probe.cli.output import print_rows, say, write_arrow, write_rows, wrote
from probe.cli.render import render_rows, terminal_width, visible
from probe.client.results import Rows
from probe.errors import UsageError

__all__ = ["query_across_ranks", "query_members"]


def query_across_ranks(cli: CliContext, sql: str, fmt: str, wide: bool, output: Optional[str],
                       file_fmt: Optional[str], max_rows: Optional[int], timeout: Optional[float],
                       merge: Optional[str]) -> None:
    cluster = cli.cluster()
    arrow = bool(merge) or file_fmt in ("parquet", "arrow")
    query_id = secrets.token_hex(8)  # names the query on every rank, so that Ctrl-C stops it there
    try:
        combined: Any = (cluster.query if arrow else cluster.query_rows)(sql, max_rows=max_rows, timeout=timeout,
                                                                         query_id=query_id, empty_if_none=True)
    except KeyboardInterrupt:
        if cluster.progress is not None:
            cluster.progress(-1, 0, [])
        raise KeyboardInterrupt("interrupted (Ctrl-C); %s" % stopped_on_ranks(cluster, "query", query_id)) from None
    if cluster.progress is not None:
        cluster.progress(-1, 0, [])
    if merge:
        from probe.client.merge import merge_rows

        combined = merge_rows(combined, merge)
    if file_fmt in ("parquet", "arrow"):
        write_arrow(output or "", [(None, combined)], file_fmt, False)  # type: ignore[list-item]
    else:
        rows = combined if isinstance(combined, Rows) else _rows(combined)
        if output:
            write_rows(output, rows, file_fmt or "csv")
            wrote(len(rows.rows), output, rows.truncated)
        elif rows.columns or fmt != "table":  # no rank answered: nothing to tabulate, the failures say why
            print_rows(render_rows(rows, fmt, terminal_width(), wide), fmt)
    for line in cluster.asked_directly:  # node helpers that could not gather (--via)
        say("probe: " + visible(line), err=True)
    stop_where_unanswered(cluster, "query", query_id)  # after the output: the answers first
    report_failures(cli, cluster.failures, len(cluster.members))


def query_members(cli: CliContext, sql: str, fmt: str, wide: bool, output: Optional[str], file_fmt: Optional[str],
                  max_rows: Optional[int], timeout: Optional[float], merge: Optional[str]) -> None:
    """SQL over ``cluster.ranks``, the job's member list from the host helpers, run here (no rank is asked)."""
    from probe.client.local_sql import run_on_members

    if merge:
        raise UsageError("--merge groups the rows of several ranks; cluster.ranks is one table already",
                         hint="group in the query itself")
    cli.all_ranks = True
    table = run_on_members(sql, cli.cluster().ranks, max_rows, timeout)
    if file_fmt in ("parquet", "arrow"):
        write_arrow(output or "", [(None, table)], file_fmt, False)  # type: ignore[list-item]
        return
    rows = _rows(table)
    if output:
        write_rows(output, rows, file_fmt or "csv")
        wrote(len(rows.rows), output, rows.truncated)
    else:
        print_rows(render_rows(rows, fmt, terminal_width(), wide), fmt)


def _rows(table: Any) -> Rows:
    from probe.client.local_sql import rows_of

    return rows_of(table)
