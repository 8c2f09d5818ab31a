"""What each ``/v1/...`` path does. A route takes the request and returns a response; the dispatcher
turns every exception into a JSON error envelope so that nothing escapes into the target.
"""

import importlib.util
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import probe
from probe.agent.http import Request, Response
from probe.agent.identity import identity
from probe.agent.switch import fast_switching
from probe.errors import BadRequest, EvalDisabled, InternalError, NotFound, ProbeError
from probe.tables import get_table, list_tables, produce_rows

if TYPE_CHECKING:
    from probe.agent.agent import Agent

__all__ = ["Dispatcher", "ARROW_STREAM"]

ARROW_STREAM = "application/vnd.apache.arrow.stream"
_CHUNK = 500  # rows per JSON encoding call (see Response.json_rows)

Route = Callable[["Agent", Request], Response]


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
        "capabilities": {"sql": agent.sql_available(), "arrow": _available("pyarrow"),
                         "eval": agent.options.eval_enabled},
    })
    return Response.json(info)


def tables(agent: "Agent", request: Request) -> Response:
    return Response.json({"tables": [spec.describe() for spec in list_tables()]})


def schema(agent: "Agent", request: Request) -> Response:
    name = request.path[len("/v1/tables/"):]
    spec = get_table(name)
    if spec is None:
        raise NotFound("no table named %r" % name, hint="list the tables with `probe TARGET tables`")
    return Response.json(spec.describe())


def rows(agent: "Agent", request: Request) -> Response:
    """The raw rows of one table: for ``backtrace``, and for SQL run by a client when we cannot."""
    body = request.json()
    name = body.get("table")
    if not isinstance(name, str):
        raise BadRequest("give the table's name as {\"table\": \"ns.name\"}")
    spec = get_table(name)
    if spec is None:
        raise NotFound("no table named %r" % name, hint="list the tables with `probe TARGET tables`")
    with fast_switching():
        data = produce_rows(spec)
    columns = [{"name": c.name, "type": c.type} for c in spec.columns]
    chunks = (data[i:i + _CHUNK] for i in range(0, len(data), _CHUNK))
    return Response.json_rows({"table": name, "columns": columns, "truncated": False}, chunks)


def backtrace(agent: "Agent", request: Request) -> Response:
    """Every thread's stack in a compact form: distinct frames once, threads as lists of indices.

    The rows of python.backtrace repeat each shared frame per thread; for hundreds of threads that
    multiplies the JSON the agent encodes (holding the GIL) and the client decodes.
    """
    from probe.tables.python_backtrace import snapshot

    with fast_switching():
        stacks, frames = snapshot()
    return Response.json({"threads": stacks, "frames": frames})


def query(agent: "Agent", request: Request) -> Response:
    body = request.json()
    sql = body.get("sql")
    if not isinstance(sql, str) or not sql.strip():
        raise BadRequest("give the SQL as {\"sql\": \"SELECT ...\"}")
    max_rows = _optional_number(body, "max_rows", int)
    timeout = _optional_number(body, "timeout", float)
    engine = agent.engine()
    with fast_switching():
        result = engine.query(sql, max_rows=max_rows, timeout=timeout)
    if ARROW_STREAM in request.headers.get("accept", ""):
        return Response(200, _arrow_stream(result), ARROW_STREAM,
                        {"X-Probe-Truncated": "true" if result.truncated else "false",
                         "X-Probe-Elapsed-Ms": "%.3f" % result.elapsed_ms})
    return Response.json_rows(result.json_head(), result.row_chunks(_CHUNK))


def evaluate(agent: "Agent", request: Request) -> Response:
    if not agent.options.eval_enabled:
        raise EvalDisabled("eval is switched off in this agent (it was started with --no-eval or PROBE_EVAL=0)",
                           hint="use SQL queries, or restart the agent with eval enabled")
    body = request.json()
    code = body.get("code")
    if not isinstance(code, str):
        raise BadRequest("give the snippet as {\"code\": \"...\"}")
    timeout = _optional_number(body, "timeout", float) or agent.options.eval_timeout
    from probe.agent.evaluator import run_snippet

    outcome = run_snippet(code, min(timeout, agent.options.eval_timeout))
    return Response.json(outcome.to_json_dict())


def _optional_number(body: Dict[str, Any], key: str, kind: type) -> Optional[Any]:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise BadRequest("%s must be a non-negative number" % key)
    return kind(value)


def _arrow_stream(result: Any) -> bytes:
    import pyarrow as pa

    table = result.table.replace_schema_metadata({"probe.truncated": "true" if result.truncated else "false"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


_EXACT: Dict[Tuple[str, str], Route] = {
    ("GET", "/v1/health"): health,
    ("GET", "/v1/tables"): tables,
    ("POST", "/v1/rows"): rows,
    ("GET", "/v1/backtrace"): backtrace,
    ("POST", "/v1/query"): query,
    ("POST", "/v1/eval"): evaluate,
}


class Dispatcher:
    """Authorises, routes, and converts every failure into an error response."""

    def __init__(self, agent: "Agent") -> None:
        self._agent = agent

    def __call__(self, request: Request) -> Response:
        try:
            self._agent.authorize(request)
            return self._route(request)(self._agent, request)
        except ProbeError as exc:
            return Response.error(exc)
        except Exception as exc:  # a bug of ours: report it, keep serving
            return Response.error(InternalError("internal error: %s: %s" % (type(exc).__name__, exc)))

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
