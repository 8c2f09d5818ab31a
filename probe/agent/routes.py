"""What each ``/v1/...`` path does: the route table, and the dispatcher that authorises each request,
records it in the audit trail and turns every exception into a JSON error envelope, so that nothing
escapes into the target. The routes themselves: ``probe.agent.routes_read`` (health, tables, rows, SQL)
and ``probe.agent.routes_act`` (eval, debugger, lr, checkpoint, trace, profile).

Imports run one way: the agent imports this dispatcher, the dispatcher its routes, and the routes the
tables and the engine; a route sees the agent only as ``probe.agent.route_common.ServingAgent``.
"""

from typing import Any, Callable, Dict, List, Tuple

import probe.agent.scopes as scopes
import probe.tables.process_env as process_env
import probe.tables.redact as redact
from probe.agent.audit_request import Audited, record_unauthorized
from probe.agent.handshake import HELLO_PATH
from probe.agent.http import Request, Response
from probe.agent.route_common import Route, ServingAgent
from probe.agent.routes_act import (complete, debug_start, debug_stop, evaluate, interrupt_eval, torch_checkpoint,
                                    torch_lr, torch_profile, torch_trace)
from probe.agent.routes_read import ARROW_STREAM, backtrace, health, interrupt_query, query, rows, schema, tables
from probe.errors import BadRequest, InternalError, NotFound, ProbeError, Unauthorized

__all__ = ["Dispatcher", "ARROW_STREAM"]


_EXACT: Dict[Tuple[str, str], Route] = {
    ("GET", "/v1/health"): health,
    ("GET", "/v1/tables"): tables,
    ("POST", "/v1/rows"): rows,
    ("GET", "/v1/backtrace"): backtrace,
    ("POST", "/v1/query"): query,
    ("POST", "/v1/eval"): evaluate,
    ("POST", "/v1/torch/checkpoint"): torch_checkpoint,
    ("POST", "/v1/torch/trace"): torch_trace,
    ("POST", "/v1/torch/profile"): torch_profile,
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

    def __init__(self, agent: ServingAgent) -> None:
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
