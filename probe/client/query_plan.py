"""One query, planned once: which sources it reads, where its SQL runs, what is merged; then fetched and
combined here, so that a command (``probe ... query``, a script) only shows the one result.

    plan = plan_query(sql, across_ranks=True, merge="SELECT max(step) FROM result")
    result = combine_ranks(plan, fetch_ranks(plan, cluster))      # a pyarrow.Table, or Rows

Three plans: ``members`` (SQL over ``cluster.ranks``, the job's member list, and
``cluster.stack_history``, the stacks its node helpers sampled, run here: no rank is asked); ``ranks``
(the SQL runs on every rank, where each rank's source runs it, the rows come back with ``rank`` and
``host`` first, and ``--merge`` runs here over their union, the table ``result``); and
``targets`` (each target given runs it, a ``target`` column first when there are several). Where the SQL
of one source runs (its agent, or here over the rows it sent, or over stacks read from outside) is the
source's own affair (``probe.client.client``, ``probe.client.local_sql``).
"""

import os
from typing import Any, NamedTuple, Optional, Sequence, Tuple

from probe.client.results import Rows
from probe.errors import UsageError

__all__ = ["QueryPlan", "MEMBERS", "RANKS", "TARGETS", "plan_query", "fetch_members", "fetch_ranks",
           "combine_ranks", "fetch_one", "combine_targets"]

MEMBERS, RANKS, TARGETS = "members", "ranks", "targets"


class QueryPlan(NamedTuple):
    """What a query reads and where its SQL runs. ``arrow``: the result is wanted as a ``pyarrow.Table``
    (a .parquet or .arrow file), else as :class:`Rows`; ``query_id`` names it on every source, so that
    an interrupt stops it there."""

    sql: str
    over: str
    merge: Optional[str] = None
    arrow: bool = False
    max_rows: Optional[int] = None
    timeout: Optional[float] = None
    native: bool = False
    query_id: str = ""


def plan_query(sql: str, across_ranks: bool = False, merge: Optional[str] = None, arrow: bool = False,
               max_rows: Optional[int] = None, timeout: Optional[float] = None, native: bool = False) -> QueryPlan:
    """The plan for ``sql``; a merge that has no ranks' rows to merge is a usage error, said before anything
    is asked."""
    from probe.client.local_sql import names_members

    if names_members(sql):
        if merge:
            raise UsageError("--merge groups the rows of several ranks; cluster.ranks is one table already",
                             hint="group in the query itself")
        over = MEMBERS
    elif across_ranks:
        over = RANKS
    else:
        if merge:
            raise UsageError("--merge runs over the rows of several ranks", hint="add --all-ranks or --ranks LIST")
        over = TARGETS
    # as secrets.token_hex(8), without the hashlib that secrets imports
    return QueryPlan(sql, over, merge, arrow, max_rows, timeout, native, os.urandom(8).hex())


def fetch_members(plan: QueryPlan, cluster: Any) -> Any:
    """SQL over the job's member list, run here."""
    from probe.client.local_sql import rows_of, run_on_members

    table = run_on_members(plan.sql, cluster.ranks, plan.max_rows, plan.timeout, cluster)
    return table if plan.arrow else rows_of(table)


def fetch_ranks(plan: QueryPlan, cluster: Any) -> Any:
    """Every rank's rows, ``rank`` and ``host`` first (no rows where none answered: ``cluster.failures``
    says why); Arrow where the plan merges or wants Arrow, else plain rows."""
    ask = cluster.query if plan.arrow or plan.merge else cluster.query_rows
    return ask(plan.sql, max_rows=plan.max_rows, timeout=plan.timeout, query_id=plan.query_id, empty_if_none=True)


def combine_ranks(plan: QueryPlan, fetched: Any) -> Any:
    """The ranks' rows as the plan wants them: merged here where it says so."""
    if plan.merge:
        from probe.client.merge import merge_rows

        fetched = merge_rows(fetched, plan.merge)
    if plan.arrow or isinstance(fetched, Rows):
        return fetched
    from probe.client.local_sql import rows_of

    return rows_of(fetched)


def fetch_one(plan: QueryPlan, source: Any) -> Any:
    """One target's answer (a :class:`probe.client.sources.Source`)."""
    ask = source.query if plan.arrow else source.query_rows
    return ask(plan.sql, max_rows=plan.max_rows, timeout=plan.timeout, native=plan.native, query_id=plan.query_id)


def combine_targets(plan: QueryPlan, answers: Sequence[Tuple[str, Any]], several: Optional[bool] = None) -> Any:
    """The answers of the targets (``(label, answer)``, in the order given) as one result, a ``target``
    column first where several were asked (``several``; default: more than one answered). An Arrow result
    keeps ``probe.truncated`` where any was cut."""
    several = len(answers) > 1 if several is None else several
    if not plan.arrow:
        return Rows.concat([rows.with_column("target", label) if several else rows for label, rows in answers])
    import pyarrow as pa

    tables = []
    for label, table in answers:
        if several:
            table = table.add_column(0, "target", pa.array([label] * table.num_rows, pa.string()))
        tables.append(table.replace_schema_metadata(None))
    combined = pa.concat_tables(tables) if tables else pa.table({})
    if any((t.schema.metadata or {}).get(b"probe.truncated") == b"true" for _, t in answers):
        combined = combined.replace_schema_metadata({b"probe.truncated": b"true"})
    return combined
