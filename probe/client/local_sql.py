"""SQL run by the client, in the same locked-down engine the agent would use: for agents that leave
DuckDB and pyarrow out of their process (the default, unless the program imported both itself or
``PROBE_SQL_IN_AGENT=1``) or cannot import them (the agent still produces its tables' raw rows; the
client fetches the tables a query names), over stacks read from outside, and over a job's member list
(``cluster.ranks``).
"""

import os
import re
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from probe.client.results import Rows

Client = Any  # a probe.client.Client: it calls this module, so the name is not imported here

__all__ = ["TABLE_ROWS", "run_locally", "run_here", "set_max_memory", "run_on_stacks", "run_on_members",
           "names_members", "rows_of"]


TABLE_ROWS = 100_000
"""The most rows of one table the client asks an agent for to run SQL over it (more when a query's own
``max_rows`` is larger; an agent caps it at its ``--max-rows`` ceiling). A table cut there makes the
result ``truncated``, and the client's ``note`` names it."""
MAX_ROWS, TIMEOUT_S = 100_000, 10.0  # a query's limits here unless it asks for others, as an agent's defaults
MAX_ROWS_CEILING, TIMEOUT_CEILING_S = 1_000_000, 60.0  # how far it may raise them, as an agent's ceilings
MAX_MEMORY = 1 << 30
"""What SQL run here may take (``--max-memory``): the address space its worker process may grow by."""

_kept: List[Any] = []  # the engine of this process, once made
_exit_hook: List[bool] = []
_kept_lock = threading.Lock()
_parser: List[Any] = []
_current = threading.local()  # the tables of the query this thread runs


def run_locally(client: Client, sql: str, max_rows: Optional[int], timeout: Optional[float],
                query_id: Optional[str] = None) -> Any:
    """``sql`` run here, in the same locked-down engine as an agent's, over the rows of the tables it
    names, fetched from the agent (``/v1/rows``): for agents that leave DuckDB out of their process, or
    cannot import it. ``query_id`` lets :meth:`Client.interrupt_query` stop it. One engine serves every
    query of this process that it can (opening one costs ~25 ms, a query over small tables ~2 ms).

    The work runs on a thread of its own: DuckDB does not let Ctrl-C through (where it looks at Python's
    signals it turns one into an error of its own, which the parse's fallback would take), so this one
    waits, and on KeyboardInterrupt interrupts the query and lets it go on as usual."""
    state: Dict[str, Any] = {"named": query_id or "local-" + os.urandom(6).hex(), "stop": False}

    done = threading.Event()

    def work() -> None:
        try:
            state["result"] = _run_locally(client, sql, max_rows, timeout, query_id, state)
        except BaseException as exc:
            state["error"] = exc
        finally:
            done.set()

    # An Event, not Thread.join: a KeyboardInterrupt inside join can mark a running thread stopped.
    worker = threading.Thread(target=work, name="probe-local-sql", daemon=True)
    try:
        worker.start()
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        state["stop"] = True
        engine = state.get("engine")
        if engine is not None:
            engine.interrupt(state["named"])
        done.wait(5.0)
        if query_id is not None:  # stopped here: the interrupt the command sends next says so
            client._local_queries[query_id] = _STOPPED
        raise
    if "error" in state:
        raise state["error"]
    return state["result"]


def _run_locally(client: Client, sql: str, max_rows: Optional[int], timeout: Optional[float],
                 query_id: Optional[str], state: Dict[str, Any]) -> Any:
    from probe.engine.sandbox import _check_size
    from probe.errors import NotFound, SQLError, Timeout, TooLarge
    from probe.tables.arrow import to_arrow

    _check_size(sql)
    engine = _engine()
    engine.start()  # it imports DuckDB while the rows come
    ask = max(max_rows or 0, TABLE_ROWS)
    tables: Dict[str, Any] = {}
    cut: List[str] = []
    absent: List[Any] = []  # the agent's own word on a table it has no rows for ("no torch trace has run")
    names, columns = _named(sql)
    for name in sorted(names):
        if "." not in name:
            continue  # a CTE or an unqualified name: DuckDB resolves (or rejects) it itself
        if state["stop"]:
            raise KeyboardInterrupt
        try:
            rows = client.table_rows(name, max_rows=ask, columns=columns)
        except NotFound as exc:
            absent.append((name, exc))
            continue  # DuckDB's own "does not exist" error names it, unless the agent said why
        except TooLarge as exc:
            raise TooLarge("%s: %s, whose rows the client fetches to run this query on its side"
                           % (exc.message, name),
                           hint="run the query in the agent instead (PROBE_SQL_IN_AGENT=1 where the target "
                                "starts: DuckDB loads there)") from None
        if rows.truncated:
            cut.append(name)
        tables[name] = to_arrow(rows.columns, [_revive(rows.columns, r) for r in rows.rows])
    named = state["named"]
    state["engine"] = engine
    if query_id is not None:
        client._local_queries[query_id] = engine
    if state["stop"] or (query_id is not None and query_id in client._stopped_early):
        engine.interrupt(named)  # its interrupt came first: it stops as it starts
    limit = min(TIMEOUT_S if timeout is None else timeout, TIMEOUT_CEILING_S)
    _current.source = tables.get
    try:
        result = engine.query(sql, max_rows=min(MAX_ROWS if max_rows is None else max_rows, MAX_ROWS_CEILING),
                              timeout=limit, query_id=named, tables=tables)
    except SQLError:
        said = _said_absent(client, absent, names)
        if said is not None:  # a table the agent has and no rows for ("no torch trace has run"): its reason
            raise said from None
        raise
    except Timeout:
        raise Timeout("query interrupted after %g s, its time limit, or by an interrupt (it ran in the probe client, "
                      "over the rows the agent sent)" % limit,
                      hint="narrow the query, or raise the limit with --query-timeout (up to %g s)"
                      % TIMEOUT_CEILING_S) from None
    except TooLarge as exc:
        if not exc.message.startswith("the query needed more memory"):
            raise  # the result's bound in bytes, or a value refused before it is built: not about --max-memory
        raise TooLarge("%s (it ran in the probe client, over the rows the agent sent)" % exc.message,
                       hint="select fewer or smaller values, or give the client more with --max-memory (now %s)"
                       % _size(MAX_MEMORY)) from None
    finally:
        _current.source = None
        if query_id is not None:
            client._local_queries.pop(query_id, None)
    if cut:
        client.note = ("run here over the rows the agent sent, and it sent the first %s rows of %s only: the "
                       "result may be incomplete (PROBE_SQL_IN_AGENT=1 where the target starts runs SQL there, "
                       "over every row)" % ("{:,}".format(ask), ", ".join(cut)))
    truncated = result.truncated or bool(cut)
    return result.table.replace_schema_metadata({"probe.truncated": "true" if truncated else "false"})


class _Stopped:
    """Stands for a query stopped here by Ctrl-C, for the interrupt the command sends after it."""

    def interrupt(self, query_id: str) -> str:
        return "interrupted"


_STOPPED = _Stopped()


def _current_source(name: str) -> Any:
    """The table ``name`` of the query this thread runs (given with it, or from its own source)."""
    source = getattr(_current, "source", None)
    return source(name) if source is not None else None


def set_max_memory(size: int) -> None:
    """What SQL run here may take (``probe T query --max-memory``): the worker's ceiling, DuckDB's own limit
    half of it. An engine kept with another ceiling is closed; the next query starts one with this."""
    global MAX_MEMORY
    with _kept_lock:
        MAX_MEMORY = int(size)
        engines, _kept[:] = list(_kept), []
    for engine in engines:
        engine.close()


def _engine() -> Any:
    """The engine every query run here uses: DuckDB in a worker process under ``MAX_MEMORY``
    (``probe.engine.isolated``), kept for the next queries (starting one costs 0.3-1 s)."""
    from probe.engine.isolated import IsolatedEngine

    with _kept_lock:
        if not _kept:
            import atexit

            if not _exit_hook:
                atexit.register(_close_kept)
                _exit_hook.append(True)
            _kept.append(IsolatedEngine(_current_source, max_rows=MAX_ROWS_CEILING, timeout=TIMEOUT_CEILING_S,
                                        memory_limit="%dMiB" % max(1, MAX_MEMORY >> 21), max_memory=MAX_MEMORY))
        return _kept[0]


def _close_kept() -> None:
    with _kept_lock:
        engines, _kept[:] = list(_kept), []
    for engine in engines:
        engine.close()


def _said_absent(client: Client, absent: List[Tuple[str, Any]], names: Set[str]) -> Any:
    """The agent's own error for a table it lists but could give no rows of; for a name that is a slip of
    one it lists (``python.threds``, ``threads``), that table named; None where neither (a file name in COPY:
    DuckDB's error says it best)."""
    from probe.errors import SQLError
    from probe.tables.suggest import meant_table

    try:
        listed = {t.name for t in client.tables()}
    except Exception:  # the agent stopped answering: DuckDB's error stands
        return None
    said = next((exc for name, exc in absent if name in listed), None)
    if said is not None:
        return said
    for name in sorted(n for n in names if n not in listed):
        meant = meant_table(name, listed)
        if meant is not None:
            return SQLError("no table named %r: did you mean %s?" % (name, meant),
                            hint="`probe %s tables` lists every table" % client.target.label)
    return None


def _named(sql: str) -> Tuple[Set[str], Optional[List[str]]]:
    """The tables ``sql`` names, and the names of the columns it may read of them (None: it may read any,
    as ``*`` does). DuckDB's parser answers, on an empty database of its own (see referenced_tables)."""
    import duckdb

    from probe.engine.sandbox import _serialized, referenced_tables

    with _kept_lock:
        if not _parser:
            _parser.append(duckdb.connect(":memory:", config={"enable_external_access": False, "threads": 1}))
        cursor = _parser[0].cursor()
    try:
        tables = referenced_tables(sql, cursor)
        return tables, _columns_read(_serialized(cursor, sql), tables)
    finally:
        cursor.close()


def _columns_read(serialized: str, tables: Set[str]) -> Optional[List[str]]:
    """Every name a column reference of the parsed query uses (each part of ``a.b.c``), and the columns
    of ``USING``; None where it may read columns it does not name: ``*``, ``COLUMNS(...)``, a NATURAL
    join, a whole row by its table's name or alias, or a tree that cannot be read (not a SELECT). A name
    too many only costs bytes on the wire; one too few would fail the query, never change its answer."""
    import json

    try:
        tree = json.loads(serialized)
    except ValueError:
        return None
    if not isinstance(tree, dict) or tree.get("error") or not tree.get("statements"):
        return None
    refs: List[List[str]] = []
    relations = {table.rsplit(".", 1)[-1] for table in tables}
    stack: List[Any] = [tree["statements"]]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("class")
        if kind == "STAR" or node.get("ref_type") == "NATURAL":
            return None
        if node.get("type") == "BASE_TABLE" and isinstance(node.get("alias"), str):
            relations.add(node["alias"].lower())
        if kind == "COLUMN_REF":
            refs.append([str(p).lower() for p in node.get("column_names") or []])
        refs.append([str(name).lower() for name in node.get("using_columns") or []])
        stack.extend(value for value in node.values() if isinstance(value, (dict, list)))
    if any(len(parts) == 1 and parts[0] in relations for parts in refs):
        return None  # maybe a whole row (SELECT t FROM python.threads t)
    names = {part for parts in refs for part in parts}
    return sorted(names)


def run_on_stacks(sql: str, stacks: Any, max_rows: Optional[int], timeout: Optional[float], why: Any,
                  label: str) -> Any:
    """SQL over stacks read from outside a process (``probe.reader``): ``python.backtrace`` is there, and
    for a live process on this host or a core file ``python.locals``, read from outside when a query names it
    (``probe.reader.locals_source``); any other table needs the agent, and the error says why it cannot
    answer."""
    from probe.errors import AgentBlocked, ProcessDead, ReaderError
    from probe.tables.arrow import to_arrow
    from probe.tables.python_backtrace import COLUMNS

    core = stacks.facts.get("core") if isinstance(stacks.facts.get("core"), str) else None
    live = (bool(stacks.facts.get("live")) or core is not None) and stacks.pid is not None
    reason = why.message if why is not None else "%s is read from outside" % label
    cls = type(why) if isinstance(why, (AgentBlocked, ProcessDead)) else ProcessDead
    how = getattr(why, "hint", None)  # how to get an agent, where one can be had

    def fetch(name: str) -> Any:
        if name == "python.backtrace":
            return to_arrow(tuple((c.name, c.type) for c in COLUMNS), stacks.rows())
        if name == "python.locals" and live:
            from probe.reader.locals_source import read_core_locals, read_locals
            from probe.tables import python_locals

            try:
                rows = (read_core_locals(core, stacks.facts.get("executable"), stacks.pid) if core
                        else read_locals(stacks.pid))
            except ReaderError as exc:
                raise cls("python.locals needs the agent, and %s; reading them from outside failed: %s"
                          % (reason[0].lower() + reason[1:], exc.message), hint=exc.hint or how) from None
            return to_arrow(tuple((c.name, c.type) for c in python_locals.COLUMNS), rows)
        what = "python.backtrace and python.locals are" if live else "only python.backtrace is"
        raise cls("%s needs the agent, and %s" % (name, reason[0].lower() + reason[1:]),
                  hint="%s read from outside the process" % what + ("; %s" % how if how else ""))

    result = run_here(sql, fetch, max_rows, timeout)
    return result.table.replace_schema_metadata({"probe.truncated": "true" if result.truncated else "false",
                                                 "probe.source": stacks.source})


_MEMBERS = re.compile(r'\b"?cluster"?\s*\.\s*"?(ranks|stack_history)"?(?![A-Za-z0-9_])', re.IGNORECASE)


def names_members(sql: str) -> bool:
    """Whether ``sql`` reads ``cluster.ranks`` or ``cluster.stack_history``: the job's tables, answered by
    the client from the node helpers. DuckDB's parser decides (a string that spells the name does not
    count), once the text mentions one at all."""
    if not _MEMBERS.search(sql):
        return False
    import duckdb

    from probe.engine.sandbox import referenced_tables
    from probe.errors import SQLError

    connection = duckdb.connect(":memory:", config={"enable_external_access": False})
    try:
        return bool({"cluster.ranks", "cluster.stack_history"} & set(referenced_tables(sql, connection)))
    except SQLError:
        return False  # not SQL: the agent says what is wrong with it
    finally:
        connection.close()


def run_on_members(sql: str, members: Any, max_rows: Optional[int], timeout: Optional[float],
                   cluster: Any = None) -> Any:
    """SQL over a job's member list (``cluster.ranks``, as the host helpers report it) and the stacks its
    helpers sampled (``cluster.stack_history``, of ``cluster``: ``probe.client.stack_history``), run here:
    both are the helpers', not any rank's, so a query over them reaches no rank."""
    from probe.errors import UsageError

    def fetch(name: str) -> Any:
        if name == "cluster.ranks":
            return members
        if name == "cluster.stack_history" and cluster is not None:
            from probe.client.stack_history import fetch as _history, to_arrow as _history_table

            return _history_table(_history(cluster))
        raise UsageError("%s is a rank's table, and cluster.ranks (the job's member list) and cluster.stack_history "
                         "are the job's, read here from the host helpers: one query cannot read both" % name,
                         hint="ask every rank with --all-ranks (its rows carry rank and host), and group them "
                              "with --merge 'SELECT ... FROM result'")

    return run_here(sql, fetch, max_rows, timeout).table


def run_here(sql: str, source: Any, max_rows: Optional[int], timeout: Optional[float]) -> Any:
    """``sql`` in this process's engine (its worker), over the tables ``source`` gives."""
    _current.source = source
    try:
        return _engine().query(sql, max_rows=min(MAX_ROWS if max_rows is None else max_rows, MAX_ROWS_CEILING),
                               timeout=min(TIMEOUT_S if timeout is None else timeout, TIMEOUT_CEILING_S))
    finally:
        _current.source = None


def _size(size: int) -> str:
    return "%.0f MiB" % (size / (1 << 20)) if size < (1 << 30) else "%.3g GiB" % (size / (1 << 30))


def rows_of(table: Any) -> Rows:
    columns = tuple((f.name, str(f.type)) for f in table.schema)
    values = [col.to_pylist() for col in table.columns]
    truncated = (table.schema.metadata or {}).get(b"probe.truncated") == b"true"
    return Rows(columns, [list(r) for r in zip(*values)] if values else [], truncated)


def _revive(columns: Any, row: Any) -> Any:
    """JSON carried timestamps as text; turn them back into datetimes for their declared type."""
    import datetime  # here, not for every query the CLI runs

    out = list(row)
    for i, (_, sql_type) in enumerate(columns):
        if sql_type == "TIMESTAMP" and isinstance(out[i], str):
            out[i] = datetime.datetime.fromisoformat(out[i])
    return out
