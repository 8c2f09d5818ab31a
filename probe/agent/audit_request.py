"""The audit trail's side of a request (``probe.agent.audit``): what the dispatcher records before an eval
or control request runs and after, and the refusals, scope and token alike. Never raises."""

import time
from typing import Any, Callable, Dict, Optional, Tuple

import probe.agent.scopes as scopes
from probe.agent.http import Request
from probe.errors import ProbeError

__all__ = ["Audited", "record_unauthorized"]


def record_unauthorized(request: Request, exc: ProbeError, body: Callable[[], Dict[str, Any]]) -> None:
    """A TCP request without a token we know, in the audit trail's refusals (counted per asker and
    minute, as every refusal: a guesser makes a few rows, not one each). Never raises."""
    try:
        from probe.agent.audit import trail

        path = request.path.split("?", 1)[0]
        need = scopes.needed(scopes.AGENT_ROUTES, request.method, path, body)
        given = request.headers.get("authorization", "").strip()
        trail().refused(scopes.NAMES[need], "a token it does not know" if given else "no token", request.peer,
                        scopes.command_of(path, body), exc.message)
    except Exception:
        pass


class Audited:
    """One request in the audit trail: its start written at once, its end by :meth:`done`; never raises."""

    def __init__(self, request: Request, path: str, grant: Any, need: int, body: Callable[[], Dict[str, Any]]) -> None:
        self.request = request
        self.started = time.monotonic()
        self.refused = grant.scope < need
        self.need, self.grant = need, grant
        self.seq = 0
        self.trail: Any = None
        self.command = path
        try:
            from probe.agent.audit import trail

            self.command = scopes.command_of(path, body)
            self.trail = trail()
            if self.refused:
                return  # one record, written by done() with the refusal's words
            fields = body() if request.method == "POST" else {}
            code, detail = _audit_fields(path, fields)
            if path == "/v1/eval" and fields.get("origin") == "repl":
                self.command = "repl"  # the REPL's input (the client says so; the scope is eval's either way)
            self.seq = self.trail.begin(scopes.NAMES[need], grant.by, request.peer, self.command, detail, code)
        except Exception:
            self.trail = None

    def done(self, exc: Optional[BaseException]) -> None:
        if self.trail is None:
            return
        try:
            if self.refused:
                self.trail.refused(scopes.NAMES[self.need], self.grant.by, self.request.peer, self.command,
                                   getattr(exc, "message", None) or str(exc))
                return
            outcome, error = self.request.__dict__.get("outcome") or ("ok", None)
            if exc is not None:
                outcome, error = "error", getattr(exc, "message", None) or "%s: %s" % (type(exc).__name__, exc)
            self.trail.end(self.seq, self.command, outcome, error, self.started, scopes.NAMES[self.need])
        except Exception:
            pass


def _audit_fields(path: str, body: Dict[str, Any]) -> Tuple[Optional[str], Dict[str, Any]]:
    """What of a request goes into its audit record: (code, detail)."""
    if path == "/v1/eval":
        return (body.get("code") if isinstance(body.get("code"), str) else None,
                {k: body.get(k) for k in ("on", "frame", "id", "timeout")})
    if path == "/v1/torch/checkpoint":
        exprs = [e for key in ("models", "optimizers") for e in (body.get(key) or []) if isinstance(e, str)]
        return ("\n".join(exprs) if exprs else None,
                {k: body.get(k) for k in ("path", "format", "models", "optimizers", "frame", "concurrent",
                                          "overwrite")})
    if path == "/v1/complete":
        return (body.get("text") if isinstance(body.get("text"), str) else None, {"frame": body.get("frame")})
    return None, {k: v for k, v in body.items() if k not in ("code",)}
