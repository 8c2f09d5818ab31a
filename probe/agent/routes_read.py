"""The agent's routes that read: health, the tables and their rows, stacks, SQL, and a query's interrupt.
Each takes the request and returns a response; ``probe.agent.routes`` dispatches to them.
"""

import importlib.util
import json
import os
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence

import probe
from probe import _paths
from probe.agent.budget import Hold, work_slot
from probe.agent.http import Request, Response
from probe.agent.identity import identity
from probe.agent.limits import within
from probe.agent.route_common import (ServingAgent, optional_count, optional_id, optional_seconds, request_ceilings,
                                      result_budget)
from probe.agent.switch import fast_switching
from probe.errors import BadRequest, NotFound, SQLError, TooLarge
from probe.tables import get_table, list_tables, produce_rows
from probe.tables.suggest import meant_table, named_after_from

__all__ = ["ARROW_STREAM", "health", "tables", "schema", "rows", "backtrace", "query", "interrupt_query"]

ARROW_STREAM = "application/vnd.apache.arrow.stream"
_CHUNK = 500  # rows per JSON encoding call (see _json_rows)


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def health(agent: ServingAgent, request: Request) -> Response:
    info = identity()
    info.update({
        "probe_version": probe.__version__,
        "uptime_s": round(time.time() - agent.started_at, 3),
        "unix_socket": agent.unix_path,
        "tcp": agent.tcp_address,
        "tcp_reach": _reachable(agent.tcp_address),
        # the owner's to see (probe list shows it): a TCP caller holds a token already, maybe a weaker one
        "token_file": getattr(agent, "token_file", None) if agent.tcp_address and request.transport == "unix" else None,
        "tcp_error": getattr(agent, "tcp_error", None),
        "runtime_dir": os.path.dirname(agent.unix_path or "") or None,
        "runtime_dir_fallback": _paths.runtime_dir_note(),
        "tcp_note": getattr(agent, "tcp_note", None),
        "capabilities": {"sql": agent.sql_available(), "sql_in_agent": agent.sql_available() and agent.sql_here(),
                         "arrow": _available("pyarrow"),
                         "eval": agent.options.eval_enabled},
        "limits": {"query_timeout_s": agent.options.query_timeout, "eval_timeout_s": agent.options.eval_timeout,
                   "max_rows": agent.options.max_rows, "max_result_bytes": agent.options.max_result_bytes,
                   "memory_limit": agent.options.memory_limit,
                   "query_timeout_ceiling_s": max(request_ceilings().query_timeout, agent.options.query_timeout),
                   "eval_timeout_ceiling_s": max(request_ceilings().eval_timeout, agent.options.eval_timeout),
                   "max_rows_ceiling": max(request_ceilings().max_rows, agent.options.max_rows),
                   "eval_output": request_ceilings().eval_output},
    })
    return Response.json(info)


def _reachable(address: Optional[str]) -> Optional[str]:
    """The address a client can use for ``address``: an agent bound to every interface is reached by the
    host's name, not by 0.0.0.0 (or ::)."""
    if not address:
        return None
    host, _, port = address.rpartition(":")
    if host.strip("[]") in ("0.0.0.0", "::", ""):
        import socket

        return "%s:%s" % (socket.gethostname(), port)
    return address


def tables(agent: ServingAgent, request: Request) -> Response:
    return Response.json({"tables": [spec.describe() for spec in list_tables()]})


def schema(agent: ServingAgent, request: Request) -> Response:
    name = request.path[len("/v1/tables/"):]
    spec = get_table(name)
    if spec is None:
        raise _no_table(name)
    return Response.json(spec.describe())


def _no_table(name: str) -> NotFound:
    """No such table, with the one meant where the name is a slip of one (``python.threds``, ``threads``)."""
    meant = meant_table(name, (spec.name for spec in list_tables()))
    return NotFound("no table named %r%s" % (name, ": did you mean %s?" % meant if meant else ""),
                    hint="list the tables with `probe TARGET tables`")


def rows(agent: ServingAgent, request: Request) -> Response:
    """The raw rows of one table: for ``backtrace``, and for SQL run by a client when we cannot."""
    body = request.json()
    name = body.get("table")
    if not isinstance(name, str):
        raise BadRequest("give the table's name as {\"table\": \"ns.name\"}")
    spec = get_table(name)
    if spec is None:
        raise NotFound("no table named %r" % name, hint="list the tables with `probe TARGET tables`")
    cap = optional_count(body, "max_rows")  # a client running SQL over the table asks for at most this many
    if cap is not None:
        cap = min(cap, max(agent.options.max_rows, request_ceilings().max_rows))
    keep = _kept_columns(spec, body.get("columns"))
    hold = result_budget(agent).hold()
    try:
        with work_slot(agent.options.query_timeout), fast_switching():
            data = produce_rows(spec)
            cut = cap is not None and len(data) > cap
            if cut:
                data = data[:cap]
            if keep is not None:
                data = [tuple(row[i] for i in keep) for row in data]
            columns = [{"name": c.name, "type": c.type} for i, c in enumerate(spec.columns)
                       if keep is None or i in keep]
            chunks = (data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK))
            payload = _json_rows({"table": name, "columns": columns, "truncated": cut}, chunks, hold,
                                 2 * agent.options.max_result_bytes)
    except BaseException:
        hold.release()
        raise
    return Response(200, payload, on_sent=hold.release)  # held until sent: slow readers count too


def _kept_columns(spec: Any, asked: Any) -> Optional[List[int]]:
    """The positions of the columns a client asked for by name (``"columns": [...]``: those its SQL
    names), in the table's order; at least one, so that the rows are still counted. None: all."""
    if asked is None:
        return None
    if not isinstance(asked, list) or not all(isinstance(a, str) for a in asked) or len(asked) > 4096:
        raise BadRequest("columns must be a list of column names")
    wanted = {a.lower() for a in asked}
    keep = [i for i, c in enumerate(spec.columns) if c.name.lower() in wanted]
    return keep or [0]


def backtrace(agent: ServingAgent, request: Request) -> Response:
    """Every thread's stack in a compact form: distinct frames once, threads as lists of indices.

    The rows of python.backtrace repeat each shared frame per thread; for hundreds of threads that
    multiplies the JSON the agent encodes (holding the GIL) and the client decodes.
    """
    from probe.tables.python_backtrace import snapshot

    with work_slot(agent.options.query_timeout), fast_switching():
        stacks, frames = snapshot()
        return Response.json({"threads": stacks, "frames": frames})


def query(agent: ServingAgent, request: Request) -> Response:
    body = request.json()
    sql = body.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise BadRequest("give the SQL as {\"sql\": \"SELECT ...\"}")
    options, ceilings = agent.options, request_ceilings()
    max_rows = int(within(optional_count(body, "max_rows"), options.max_rows, ceilings.max_rows, "--max-rows",
                          "PROBE_MAX_ROWS_CEILING"))
    timeout = within(optional_seconds(body, "timeout"), options.query_timeout, ceilings.query_timeout,
                     "--query-timeout", "PROBE_QUERY_TIMEOUT_CEILING")
    query_id = optional_id(body)
    arrow = ARROW_STREAM in request.headers.get("accept", "")
    the_plan = None if arrow else _simple_plan(agent, sql)
    engine = None
    hold = result_budget(agent).hold()
    try:
        if the_plan is None:
            engine = agent.hold_engine()
        with work_slot(timeout), fast_switching():
            result = _simple_answer(the_plan, max_rows, agent.options.max_result_bytes) if the_plan else None
            if result is None:
                engine = engine or agent.hold_engine()
                result = _run_query(engine, sql, max_rows, timeout, hold,
                                    max(ceilings.query_timeout, options.query_timeout), query_id)
            if arrow:
                payload = _arrow_stream(result)
                hold.reserve(len(payload))
                return Response(200, payload, ARROW_STREAM,
                                {"X-Probe-Truncated": "true" if result.truncated else "false",
                                 "X-Probe-Max-Rows": str(max_rows),
                                 "X-Probe-Elapsed-Ms": "%.3f" % result.elapsed_ms}, on_sent=hold.release)
            head = dict(result.json_head(), limits={"max_rows": max_rows, "timeout_s": timeout})
            body_bytes = _json_rows(head, result.row_chunks(_CHUNK), hold, 2 * agent.options.max_result_bytes)
            return Response(200, body_bytes, on_sent=hold.release)  # held until sent: slow readers count too
    except BaseException:
        hold.release()
        raise
    finally:
        if engine is not None:
            agent.let_go_engine()


def _simple_plan(agent: ServingAgent, sql: str) -> Any:
    """The plan of a query simple enough to answer without DuckDB and pyarrow (``probe.engine.simple``);
    else None."""
    from probe.engine.simple import plan

    the_plan = plan(sql)
    return the_plan if the_plan is not None and get_table(the_plan.table) is not None else None


def _simple_answer(the_plan: Any, max_rows: int, max_bytes: int) -> Any:
    from probe.engine.simple import answer

    spec = get_table(the_plan.table)
    if spec is None:
        return None
    return answer(the_plan, [(c.name, c.type) for c in spec.columns], lambda: produce_rows(spec), max_rows, max_bytes)


def interrupt_query(agent: ServingAgent, request: Request) -> Response:
    """Stop the query sent with ``{"id"}`` (a client's Ctrl-C): ``interrupted``, ``finished``, or
    ``cancelled`` (not started yet: it stops when it does)."""
    query_id = optional_id(request.json())
    if query_id is None:
        raise BadRequest("give the query's id as {\"id\": \"...\"}")
    if not agent.sql_here():
        # No query runs in DuckDB here (the client runs them; the simplest are answered at once): nothing to
        # stop, and DuckDB is not loaded for an interrupt.
        return Response.json({"id": query_id, "state": "finished"})
    # The engine is built by the first query: an interrupt that overtakes that query builds it too.
    engine = agent.hold_engine()
    try:
        return Response.json({"id": query_id, "state": engine.interrupt(query_id)})
    finally:
        agent.let_go_engine()


def _run_query(engine: Any, sql: str, max_rows: int, timeout: float, hold: Hold, ceiling: float,
               query_id: Optional[str] = None) -> Any:
    """The engine's query, its time-out said with a hint that can work (raise the limit, or narrow the query)."""
    from probe.errors import Timeout

    try:
        return engine.query(sql, max_rows=max_rows, timeout=timeout, reserve=hold.reserve, query_id=query_id)
    except SQLError:
        listed = [spec.name for spec in list_tables()]
        slip = next(((n, m) for n in named_after_from(sql) for m in [meant_table(n, listed)] if m), None)
        if slip is not None:
            raise SQLError("no table named %r: did you mean %s?" % slip,
                           hint="`probe TARGET tables` lists every table") from None
        raise
    except Timeout:
        hint = ("raise it with --query-timeout (this agent allows up to %g s), or narrow the query" % ceiling
                if timeout < ceiling else "narrow the query: %g s is this agent's ceiling (PROBE_QUERY_TIMEOUT_CEILING "
                                          "in the target's environment)" % ceiling)
        raise Timeout("query interrupted after %g s, its time limit" % timeout, hint=hint) from None


def _json_rows(head: Dict[str, Any], chunks: Iterable[Sequence[Any]], hold: Hold, limit: int) -> bytearray:
    """``head`` plus a ``rows`` array, encoded a chunk at a time into one buffer held in ``hold``.

    Encoding in chunks lets the target's threads run between them (the encoder holds the GIL for a
    whole call); one growing buffer, not a list of parts joined at the end, keeps the peak near the
    body's own size. Past ``limit`` bytes the answer is refused rather than built.
    """
    text = json.dumps(head, default=str)
    body = bytearray((text[:-1] + (", " if head else "") + '"rows": [').encode("utf-8"))
    first = True
    for chunk in chunks:
        piece = json.dumps(chunk, default=str)[1:-1]
        if not piece:
            continue
        if not first:
            body += b","
        body += piece.encode("utf-8")
        first = False
        if len(body) > limit:
            raise TooLarge("the answer is larger than %.0f MB as JSON, the agent's bound" % (limit / 1e6),
                           hint="select fewer rows or columns, or ask for Arrow (the Python client does)")
        hold.reserve(len(body))
    body += b"]}"
    return body


def _arrow_stream(result: Any) -> bytes:
    import pyarrow as pa

    table = result.table.replace_schema_metadata({"probe.truncated": "true" if result.truncated else "false"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()
