"""What each ``/v1/...`` path does. A route takes the request and returns a response; the dispatcher
turns every exception into a JSON error envelope so that nothing escapes into the target.
"""

import importlib.util
import json
import math
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import probe
from probe import _paths
from probe.agent import scopes
from probe.tables import process_env, redact
from probe.agent.handshake import HELLO_PATH
from probe.agent.budget import Hold, ResultBudget, work_slot
from probe.agent.audit_request import Audited, record_unauthorized
from probe.agent.http import Request, Response
from probe.agent.identity import identity
from probe.agent.limits import Ceilings, within
from probe.agent.switch import fast_switching
from probe.errors import BadRequest, EvalDisabled, InternalError, NotFound, ProbeError, SQLError, TooLarge, Unauthorized
from probe.tables import get_table, list_tables, produce_rows
from probe.tables.suggest import meant_table, named_after_from

if TYPE_CHECKING:
    from probe.agent.agent import Agent

__all__ = ["Dispatcher", "ARROW_STREAM"]

ARROW_STREAM = "application/vnd.apache.arrow.stream"
_CHUNK = 500  # rows per JSON encoding call (see _json_rows)

Route = Callable[["Agent", Request], Response]

_results: Optional[ResultBudget] = None


def _budget(agent: "Agent") -> ResultBudget:
    """Bytes of results held at once, across requests: four results at the agent's bound."""
    global _results
    if _results is None:
        _results = ResultBudget(4 * agent.options.max_result_bytes)
    return _results


_ceilings_now: Optional[Ceilings] = None


def _ceilings() -> Ceilings:
    """How far a request may raise the agent's limits (see probe.agent.limits), read once."""
    global _ceilings_now
    if _ceilings_now is None:
        _ceilings_now = Ceilings.from_env()
    return _ceilings_now


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def health(agent: "Agent", request: Request) -> Response:
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
                   "query_timeout_ceiling_s": max(_ceilings().query_timeout, agent.options.query_timeout),
                   "eval_timeout_ceiling_s": max(_ceilings().eval_timeout, agent.options.eval_timeout),
                   "max_rows_ceiling": max(_ceilings().max_rows, agent.options.max_rows),
                   "eval_output": _ceilings().eval_output},
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


def tables(agent: "Agent", request: Request) -> Response:
    return Response.json({"tables": [spec.describe() for spec in list_tables()]})


def schema(agent: "Agent", request: Request) -> Response:
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


def rows(agent: "Agent", request: Request) -> Response:
    """The raw rows of one table: for ``backtrace``, and for SQL run by a client when we cannot."""
    body = request.json()
    name = body.get("table")
    if not isinstance(name, str):
        raise BadRequest("give the table's name as {\"table\": \"ns.name\"}")
    spec = get_table(name)
    if spec is None:
        raise NotFound("no table named %r" % name, hint="list the tables with `probe TARGET tables`")
    cap = _optional_count(body, "max_rows")  # a client running SQL over the table asks for at most this many
    if cap is not None:
        cap = min(cap, max(agent.options.max_rows, _ceilings().max_rows))
    keep = _kept_columns(spec, body.get("columns"))
    hold = _budget(agent).hold()
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


def backtrace(agent: "Agent", request: Request) -> Response:
    """Every thread's stack in a compact form: distinct frames once, threads as lists of indices.

    The rows of python.backtrace repeat each shared frame per thread; for hundreds of threads that
    multiplies the JSON the agent encodes (holding the GIL) and the client decodes.
    """
    from probe.tables.python_backtrace import snapshot

    with work_slot(agent.options.query_timeout), fast_switching():
        stacks, frames = snapshot()
        return Response.json({"threads": stacks, "frames": frames})


def query(agent: "Agent", request: Request) -> Response:
    body = request.json()
    sql = body.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise BadRequest("give the SQL as {\"sql\": \"SELECT ...\"}")
    options, ceilings = agent.options, _ceilings()
    max_rows = int(within(_optional_count(body, "max_rows"), options.max_rows, ceilings.max_rows, "--max-rows",
                          "PROBE_MAX_ROWS_CEILING"))
    timeout = within(_optional_seconds(body, "timeout"), options.query_timeout, ceilings.query_timeout,
                     "--query-timeout", "PROBE_QUERY_TIMEOUT_CEILING")
    query_id = _optional_id(body)
    arrow = ARROW_STREAM in request.headers.get("accept", "")
    the_plan = None if arrow else _simple_plan(agent, sql)
    engine = None
    hold = _budget(agent).hold()
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


def _simple_plan(agent: "Agent", sql: str) -> Any:
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


def _optional_id(body: Dict[str, Any]) -> Optional[str]:
    """A request's own name (for a later interrupt): up to 64 letters, digits, '-' or '_'."""
    value = body.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not (0 < len(value) <= 64) or not value.replace("-", "").replace("_", "").isalnum():
        raise BadRequest("id must be 1 to 64 letters, digits, '-' or '_'")
    return value


def interrupt_query(agent: "Agent", request: Request) -> Response:
    """Stop the query sent with ``{"id"}`` (a client's Ctrl-C): ``interrupted``, ``finished``, or
    ``cancelled`` (not started yet: it stops when it does)."""
    query_id = _optional_id(request.json())
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


def evaluate(agent: "Agent", request: Request) -> Response:
    _require_eval(agent)
    body = request.json()
    code = body.get("code")
    if not isinstance(code, str):
        raise BadRequest("give the snippet as {\"code\": \"...\"}")
    ceilings = _ceilings()
    timeout = within(_optional_seconds(body, "timeout"), agent.options.eval_timeout, ceilings.eval_timeout,
                     "--eval-timeout", "PROBE_EVAL_TIMEOUT_CEILING")
    from probe.agent.evaluator import run_snippet
    from probe.agent.frames import parse_frame
    from probe.agent.placement import PLACES

    place = body.get("on", "agent")
    if place not in PLACES:
        raise BadRequest("\"on\" is one of %s" % ", ".join(PLACES))
    frame = parse_frame(body["frame"]) if body.get("frame") is not None else None
    wait = min(_optional_seconds(body, "wait") or (10.0 if place == "main" else 60.0), _MAX_WAIT)
    outcome = run_snippet(code, timeout, place, frame, _job_id(body), wait, ceilings.eval_output)
    _note_outcome(request, outcome)
    answer = outcome.to_json_dict()
    answer["limits"] = {"timeout_s": timeout, "timeout_ceiling_s": max(ceilings.eval_timeout, agent.options.eval_timeout),
                        "max_output": ceilings.eval_output, "stdout_dropped": outcome.stdout_dropped,
                        "stderr_dropped": outcome.stderr_dropped}
    return Response.json(answer)


_MAX_WAIT = 600.0  # seconds a snippet may wait for the main thread or a step


def _note_outcome(request: Request, outcome: Any) -> None:
    """What came of a snippet, for the audit trail: ok, error, or interrupted (Ctrl-C, its time limit)."""
    error = outcome.error or ""
    if outcome.timed_out or error.startswith(("EvalInterrupted", "KeyboardInterrupt")):
        request.__dict__["outcome"] = ("interrupted", error.strip().splitlines()[-1] if error.strip() else "time limit")
    elif error:
        request.__dict__["outcome"] = ("error", error.strip().splitlines()[-1])


def torch_lr(agent: "Agent", request: Request) -> Response:
    """One step of ``probe T lr`` (``probe.client.lr``): ``{"what": "plan"|"change"|"readback", "args": [...],
    "on": "agent"|"step", "wait": S}``. The agent writes the snippet itself from checked values, so that a
    learning-rate change needs the control scope, not eval's."""
    if not agent.options.eval_enabled:
        raise EvalDisabled("probe lr changes the target through eval, and the agent refuses it: eval is switched off "
                           "in this agent (it was started with --no-eval or PROBE_EVAL=0)",
                           hint="restart the target with eval enabled to change its learning rate")
    body = request.json()
    what, args, place = body.get("what"), body.get("args"), body.get("on", "agent")
    if what not in ("plan", "change", "readback") or not isinstance(args, list) or place not in ("agent", "step"):
        raise BadRequest("give {\"what\": \"plan\"|\"change\"|\"readback\", \"args\": [...], \"on\": \"agent\"|\"step\"}")
    if what == "readback":
        if len(args) != 1 or isinstance(args[0], bool) or not isinstance(args[0], int):
            raise BadRequest("readback takes one whole number, the change's token")
    else:
        value, groups, optimizer, base = (list(args) + [None, None, False])[:4] if len(args) <= 4 else (None,) * 4
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BadRequest("the learning rate must be a finite number")
        if groups is not None and not (isinstance(groups, list) and all(
                isinstance(g, int) and not isinstance(g, bool) and 0 <= g < 1 << 20 for g in groups)):
            raise BadRequest("groups must be a list of group numbers")
        if optimizer is not None and not (isinstance(optimizer, str) and len(optimizer) <= 200):
            raise BadRequest("optimizer must be a name")
        if not isinstance(base, bool):
            raise BadRequest("base must be true or false")
        args = [float(value), groups, optimizer, base]
    code = "print(__import__('probe.tables.torch.lr', fromlist=['answer']).answer(%s))" % ", ".join(
        repr(a) for a in [what] + args)
    from probe.agent.evaluator import run_snippet

    wait = min(_optional_seconds(body, "wait") or 60.0, _MAX_WAIT)
    timeout = min(_optional_seconds(body, "timeout") or 20.0, 120.0)
    outcome = run_snippet(code, timeout, place, None, _job_id(body), wait, _ceilings().eval_output)
    _note_outcome(request, outcome)
    if outcome.error is None and '"error": {' in (outcome.stdout or ""):
        request.__dict__["outcome"] = ("error", outcome.stdout.strip().splitlines()[-1][:300])
    return Response.json(outcome.to_json_dict())


def _require_eval(agent: "Agent") -> None:
    if not agent.options.eval_enabled:
        raise EvalDisabled("eval is switched off in this agent (it was started with --no-eval or PROBE_EVAL=0)",
                           hint="use SQL queries, or restart the agent with eval enabled")


def _job_id(body: Dict[str, Any]) -> Optional[str]:
    value = body.get("id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise BadRequest("id must be a string of 1 to 64 characters")
    return value


def interrupt_eval(agent: "Agent", request: Request) -> Response:
    """Interrupt the snippet sent with ``{"id": ...}`` (the REPL's Ctrl-C)."""
    _require_eval(agent)
    job_id = _job_id(request.json())
    if job_id is None:
        raise BadRequest("give the snippet's id as {\"id\": \"...\"}")
    from probe.agent.placement import interrupt_and_settle

    return Response.json(dict(interrupt_and_settle(job_id), id=job_id))


def complete(agent: "Agent", request: Request) -> Response:
    """Completions of a name or dotted attribute in ``__main__`` (or a frame), bounded in time."""
    _require_eval(agent)
    body = request.json()
    text = body.get("text")
    if not isinstance(text, str) or len(text) > 1000:
        raise BadRequest("give the text to complete as {\"text\": \"model.la\"}")
    import sys

    from probe.agent.completion import complete_bounded
    from probe.agent.frames import Scope, frame_scope, parse_frame

    frame = parse_frame(body["frame"]) if body.get("frame") is not None else None
    matches = complete_bounded(text, lambda: frame_scope(frame) if frame else Scope(sys.modules["__main__"].__dict__))
    return Response.json({"matches": matches or [], "timed_out": matches is None})


def debug_start(agent: "Agent", request: Request) -> Response:
    _require_eval(agent)
    body = request.json()
    host, port = body.get("host", "127.0.0.1"), body.get("port", 5678)
    if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise BadRequest("give {\"host\": \"127.0.0.1\", \"port\": 5678}")
    import_dir = body.get("import_dir")
    from probe.agent import debugger

    window = body.get("window_s", debugger.DEFAULT_WINDOW_S)
    if isinstance(window, bool) or not isinstance(window, (int, float)):
        raise BadRequest("window_s must be a number of seconds")
    return Response.json(debugger.start(host, port, bool(body.get("insecure")),
                                        import_dir if isinstance(import_dir, str) else None, float(window)))


def debug_stop(agent: "Agent", request: Request) -> Response:
    _require_eval(agent)
    from probe.agent import debugger

    return Response.json(debugger.stop())


def _optional_count(body: Dict[str, Any], key: str) -> Optional[int]:
    """A whole number >= 0, or None when absent; anything else is a 400."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BadRequest("%s must be a whole number >= 0, got %s" % (key, json.dumps(value)[:40]))
    return value


def _optional_seconds(body: Dict[str, Any], key: str) -> Optional[float]:
    """A finite number of seconds > 0, or None when absent; the agent's own limit still caps it."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise BadRequest("%s must be a number of seconds > 0, got %s" % (key, json.dumps(value)[:40]))
    return float(value)


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


def torch_checkpoint(agent: "Agent", request: Request) -> Response:
    """Save models, optimizers, step and RNG states to a file, atomically (see probe.tables.torch.checkpoint)."""
    if not agent.options.eval_enabled:
        raise EvalDisabled("checkpoint is switched off with eval in this agent: it writes files as the target's "
                           "user, and --model/--optimizer run code (it was started with --no-eval or PROBE_EVAL=0)",
                           hint="restart the agent with eval enabled to save checkpoints through probe")
    body = request.json()
    from probe.tables.torch.checkpoint import DEFAULT_TIMEOUT_S, save

    path = body.get("path")
    names: Dict[str, Any] = {key: body.get(key) for key in ("models", "optimizers")}
    for key, value in names.items():
        if value is not None and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise BadRequest("%s must be a list of expressions (strings)" % key)
    if not isinstance(path, str) or not path:
        raise BadRequest("give the checkpoint's path as {\"path\": \"/ckpt/x.pt\"}")
    timeout = min(_optional_seconds(body, "timeout") or DEFAULT_TIMEOUT_S, 24 * 3600.0)
    concurrent = body.get("concurrent", False)
    if not isinstance(concurrent, bool):
        raise BadRequest("concurrent must be true or false")
    fmt = body.get("format", "probe")
    if not isinstance(fmt, str):
        raise BadRequest("format must be a string (probe, hf or lightning)")
    overwrite = body.get("overwrite", False)
    if not isinstance(overwrite, bool):
        raise BadRequest("overwrite must be true or false")
    save_id = body.get("save_id", "")
    if not isinstance(save_id, str) or len(save_id) > 64 or not all(c.isalnum() and c.isascii() for c in save_id):
        raise BadRequest("save_id must be up to 64 letters and digits")
    from probe.agent.frames import frame_scope, parse_frame
    from probe.agent.placement import run_between_steps

    scope = frame_scope(parse_frame(body["frame"])) if body.get("frame") is not None else None
    return Response.json(save(path, names["models"], names["optimizers"], timeout,
                              None if concurrent else run_between_steps, scope=scope, fmt=fmt, overwrite=overwrite,
                              save_id=save_id))


def torch_trace(agent: "Agent", request: Request) -> Response:
    """Start, stop, describe or export the torch trace (see probe.tables.torch.trace.control)."""
    from probe.tables.torch.trace import control

    body = request.json()
    with work_slot(agent.options.query_timeout), fast_switching():
        return Response.json(control(body, agent.options.eval_enabled, agent.options.max_result_bytes))


_EXACT: Dict[Tuple[str, str], Route] = {
    ("GET", "/v1/health"): health,
    ("GET", "/v1/tables"): tables,
    ("POST", "/v1/rows"): rows,
    ("GET", "/v1/backtrace"): backtrace,
    ("POST", "/v1/query"): query,
    ("POST", "/v1/eval"): evaluate,
    ("POST", "/v1/torch/checkpoint"): torch_checkpoint,
    ("POST", "/v1/torch/trace"): torch_trace,
    ("POST", "/v1/torch/lr"): torch_lr,
    ("POST", "/v1/eval/interrupt"): interrupt_eval,
    ("POST", "/v1/query/interrupt"): interrupt_query,
    ("POST", "/v1/complete"): complete,
    ("POST", "/v1/debug/start"): debug_start,
    ("POST", "/v1/debug/stop"): debug_stop,
}


class Dispatcher:
    """Authorises (the token's scope against the route's, ``probe.agent.scopes``), records control and
    eval requests in the audit trail (``probe.agent.audit``), routes, and converts every failure into an
    error response."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent
        self._audit_reads = bool(getattr(agent.options, "audit_reads", False))

    def __call__(self, request: Request) -> Response:
        audit: Any = None
        try:
            if request.path == HELLO_PATH and request.method == "GET":  # no token: the listener proves it has one
                return Response.json(self._agent.credentials.hello(request))
            try:
                grant = scopes.capped(self._agent.authorize(request), request.headers)
            except Unauthorized as exc:
                record_unauthorized(request, exc, _once(request))
                raise
            except ValueError as exc:
                raise BadRequest(str(exc)) from None
            route = self._route(request)
            path = request.path.split("?", 1)[0]
            body = _once(request)
            need = scopes.needed(scopes.AGENT_ROUTES, request.method, path, body)
            if need > scopes.READ or self._audit_reads or grant.scope < need:
                audit = Audited(request, path, grant, need, body)  # before it runs (or its refusal)
            if grant.scope < need:
                raise self._agent.credentials.refuse(grant, need, audit.command)
            # python.locals shows secret-looking values to eval (it could read them anyway) or where the
            # agent shows secrets (PROBE_SHOW_SECRETS=1, as process.env does); see probe.tables.redact
            redact.reading.shows_secrets = grant.scope >= scopes.EVAL or process_env.show_secrets
            try:
                response = route(self._agent, request)
            finally:
                redact.reading.shows_secrets = False
        except ProbeError as exc:
            if audit is not None:
                audit.done(exc)
            return Response.error(exc)
        except Exception as exc:  # a bug of ours: report it, keep serving
            if audit is not None:
                audit.done(exc)
            return Response.error(InternalError("internal error: %s: %s" % (type(exc).__name__, exc)))
        if audit is not None:
            audit.done(None)
        return response

    def _route(self, request: Request) -> Route:
        path = request.path.split("?", 1)[0]
        route = _EXACT.get((request.method, path))
        if route is not None:
            return route
        if request.method == "GET" and path.startswith("/v1/tables/"):
            return schema
        if any(p == path for (_, p) in _EXACT):
            raise BadRequest("method %s is not allowed on %s" % (request.method, path))
        raise NotFound("no such endpoint: %s %s" % (request.method, path[:200]))


def _once(request: Request) -> Callable[[], Dict[str, Any]]:
    """``request.json`` parsed at most once by whoever asks first (the scope, the audit record)."""
    parsed: List[Dict[str, Any]] = []

    def body() -> Dict[str, Any]:
        if not parsed:
            parsed.append(request.json())
        return parsed[0]

    return body
