"""What each request may do: the three scopes, the one table that gives every route its scope, and the
tokens (and the unix socket's owner) that grant them.

    read     queries, backtrace, tables, schema, health, ranks, the audit trail
    control  trace start/stop/export, profile, checkpoint (of what probe finds), debug stop, learning-rate change,
             interrupting a snippet
    eval     eval and the REPL, completion, debug start, checkpoint's --model/--optimizer/--frame (they
             evaluate expressions)

Each scope includes the ones above it. ``PROBE_TOKEN``/``PROBE_TOKEN_FILE`` is the full token (eval);
``PROBE_CONTROL_TOKEN(_FILE)`` and ``PROBE_READ_TOKEN(_FILE)`` give control and read. The unix socket's
owner has eval unless ``PROBE_UNIX_SCOPE=read|control`` lowers it. A route missing from the table needs
eval: a new route is closed until someone gives it its scope here. Stdlib only: runs in the target.
"""

import hmac
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import probe.agent.handshake as handshake
from probe.errors import BadRequest, Forbidden, Unauthorized

if TYPE_CHECKING:
    from probe.agent.http import Request

__all__ = ["READ", "CONTROL", "EVAL", "NAMES", "AGENT_ROUTES", "HELPER_ROUTES", "Grant", "Credentials",
           "needed", "parse_scope", "capped", "check", "command_of", "helper_credentials"]

READ, CONTROL, EVAL = 1, 2, 3
NAMES = {READ: "read", CONTROL: "control", EVAL: "eval"}


def _trace(body: Mapping[str, Any]) -> int:
    # No trace option runs code (every, modules, backward, anomalies, size are data); start/stop change
    # what the training step runs, export hands out the recorded spans.
    return READ if body.get("action") == "status" else CONTROL


def _profile(body: Mapping[str, Any]) -> int:
    # start/stop change what the training step runs, fetch hands out the captured ops; status only reads.
    return READ if body.get("action") == "status" else CONTROL


def _checkpoint(body: Mapping[str, Any]) -> int:
    # --model/--optimizer are Python expressions evaluated in the target; --frame opens a frame's locals to them.
    return EVAL if body.get("models") or body.get("optimizers") or body.get("frame") is not None else CONTROL


Needed = Union[int, Callable[[Mapping[str, Any]], int]]

#: What a caller without a token is told: how to get one in general words, never where the job keeps it.
TOKEN_HINT = ("pass --token-file FILE with a token of the job: its owner has the full token and may give you a "
              "read or control token")

#: (method, path) -> the scope it needs, or a function of the JSON body for the routes whose body decides.
#: ``GET /v1/tables/NAME`` (a table's schema) is looked up as ("GET", "/v1/tables/").
AGENT_ROUTES: Dict[Tuple[str, str], Needed] = {
    ("GET", "/v1/health"): READ,
    ("GET", "/v1/tables"): READ,
    ("GET", "/v1/tables/"): READ,
    ("POST", "/v1/rows"): READ,
    ("GET", "/v1/backtrace"): READ,
    ("POST", "/v1/query"): READ,
    ("POST", "/v1/query/interrupt"): READ,
    ("POST", "/v1/torch/trace"): _trace,
    ("POST", "/v1/torch/profile"): _profile,
    ("POST", "/v1/torch/checkpoint"): _checkpoint,
    ("POST", "/v1/torch/lr"): CONTROL,
    ("POST", "/v1/debug/stop"): CONTROL,
    ("POST", "/v1/eval/interrupt"): CONTROL,
    ("POST", "/v1/eval"): EVAL,
    ("POST", "/v1/complete"): EVAL,  # completion reads attributes: properties and __getattr__ run
    ("POST", "/v1/debug/start"): EVAL,
}

#: The host helper's routes. A node's report (``/v1/nodes``) names the addresses clients then send their
#: tokens to, so only the job's full token may make one.
HELPER_ROUTES: Dict[Tuple[str, str], Needed] = {
    ("GET", "/v1/health"): READ,
    ("GET", "/v1/ranks"): READ,
    ("GET", "/v1/outside/"): READ,
    ("POST", "/v1/gather"): READ,  # backtrace and SQL only (probe.host.gather): the ranks answer read requests
    ("POST", "/v1/register"): READ,  # unix only (the helper refuses it on TCP)
    ("POST", "/v1/nodes"): EVAL,
    ("GET", "/v1/stack_history"): READ,
}


def needed(table: Mapping[Tuple[str, str], Needed], method: str, path: str, body: Callable[[], Mapping[str, Any]]) -> int:
    """The scope ``method path`` needs by ``table``; ``body()`` is asked only of routes whose body decides."""
    rule = table.get((method, path))
    if rule is None:
        slash = path.find("/", len("/v1/"))
        rule = table.get((method, path[:slash + 1])) if slash > 0 else None
    if rule is None:
        return EVAL
    if isinstance(rule, int):
        return rule
    try:
        return rule(body())
    except Exception:
        return EVAL  # a body the route will refuse anyway: ask the most


_WORDS = {"/v1/eval": "eval", "/v1/complete": "completion", "/v1/debug/start": "debug start",
          "/v1/debug/stop": "debug stop", "/v1/torch/checkpoint": "checkpoint", "/v1/torch/lr": "lr",
          "/v1/eval/interrupt": "interrupting a snippet", "/v1/query": "query", "/v1/rows": "reading a table",
          "/v1/backtrace": "backtrace", "/v1/nodes": "a node's report"}


def command_of(path: str, body: Callable[[], Mapping[str, Any]]) -> str:
    """A request in the words of the command that sends it (``trace start``, ``checkpoint --model``)."""
    word = _WORDS.get(path)
    try:
        if path in ("/v1/torch/trace", "/v1/torch/profile"):
            return "%s %s" % (path.rsplit("/", 1)[1], str(body().get("action"))[:20])
        if word == "checkpoint" and _checkpoint(body()) == EVAL:
            return "checkpoint with --model/--optimizer/--frame"
    except Exception:
        pass
    return word or path[:100]


def capped(grant: "Grant", headers: Mapping[str, str]) -> "Grant":
    """``grant`` lowered to the scope the request asks for in ``X-Probe-Scope`` (a client that serves
    others what it reads, ``probe mcp`` or the page, asks for no more than it needs); never raised.
    ValueError for a header that names no scope."""
    asked = headers.get("x-probe-scope")
    if not asked:
        return grant
    cap = parse_scope(asked, "X-Probe-Scope")
    return grant if cap >= grant.scope else Grant(cap, grant.by)


def parse_scope(text: Optional[str], what: str) -> int:
    """``read``/``control``/``eval`` (or ``all``/``full``/empty: eval) -> the scope; ValueError otherwise."""
    value = (text or "").strip().lower()
    if value in ("", "eval", "all", "full"):
        return EVAL
    for scope, name in NAMES.items():
        if value == name:
            return scope
    raise ValueError("%s is read, control or eval, got %r" % (what, text))


class Grant:
    """What one request may do: its scope and how it got it (for the refusal and the audit)."""

    __slots__ = ("scope", "by")

    def __init__(self, scope: int, by: str) -> None:
        self.scope = scope
        self.by = by  # "full token", "control token", "read token", "unix socket owner"


class Credentials:
    """The tokens accepted on TCP, each with its scope (at most one each), and the unix owner's scope."""

    def __init__(self, tokens: List[Tuple[bytes, int, str]], unix_scope: int = EVAL,
                 files: Optional[Dict[int, str]] = None) -> None:
        self.tokens = [(t, s, by) for t, s, by in tokens if t]
        self.unix_scope = unix_scope
        self.files = files or {}  # scope -> the token file that holds the token of that scope (for hints)
        self.nonces = handshake.Nonces()  # the hello nonces handed out, each taken back once

    def grant(self, request: "Request", what: str = "this agent") -> Grant:
        """The scope of a request; ``Unauthorized`` for a TCP request that does not prove it holds one of our
        tokens (``probe.agent.handshake``: the token itself never travels, and a bearer token is refused)."""
        if request.transport == "unix":
            return Grant(self.unix_scope, "unix socket owner")
        value = request.headers.get("authorization", "")
        fields = handshake.parse_authorization(value) if value else None
        if not self.tokens or fields is None:
            if value.partition(" ")[0].lower() == "bearer":
                raise Unauthorized("%s takes no bearer token on TCP: a client that sends its token sends it to "
                                   "whoever holds the port" % what,
                                   hint="use probe (it proves it holds the token without sending it), or follow "
                                        "the wire protocol (docs/reference.md): GET %s, then Authorization: %s"
                                        % (handshake.HELLO_PATH, handshake.SCHEME))
            raise Unauthorized("%s requires a token on TCP" % what, hint=TOKEN_HINT)
        scope, by = handshake.verify(self.tokens, NAMES, self.nonces, fields, request.local, request.method,
                                     request.path, request.body)
        return Grant(scope, by)

    def hello(self, request: "Request") -> Dict[str, Any]:
        """The answer to ``GET /v1/hello`` (``probe.agent.handshake``): taken without a token, since it is how
        a client asks the listener to prove it holds one."""
        return handshake.hello(self.tokens, NAMES, self.nonces, request.headers, request.local)

    def refuse(self, grant: Grant, need: int, what: str) -> Forbidden:
        """The refusal of ``what`` (a command's words) to ``grant``: the scope it needs and what gives it."""
        if grant.by == "unix socket owner":
            hint = ("this process lowered its unix socket to %s (PROBE_UNIX_SCOPE=%s); use TCP with %s"
                    % (NAMES[grant.scope], NAMES[grant.scope], self.gives(need)))
        else:
            hint = "pass --token-file with %s" % self.gives(need)
        return Forbidden("%s needs the %s scope; the %s gives %s only" % (what, NAMES[need], grant.by, NAMES[grant.scope]),
                         hint=hint)

    def gives(self, need: int) -> str:
        """Which tokens grant ``need``, by the variables that name them: never a file's path, as a refusal
        goes to whoever asked, and the path of the full token's file is a target for them."""
        names = [(EVAL, "the full token", "PROBE_TOKEN_FILE"), (CONTROL, "the control token", "PROBE_CONTROL_TOKEN_FILE"),
                 (READ, "the read token", "PROBE_READ_TOKEN_FILE")]
        out = ["%s (%s)" % (name, variable) for scope, name, variable in names if scope >= need]
        return " or ".join(out) + "; ask the job's owner for it"


def helper_credentials(full: bytes, full_file: Optional[str], environ: Optional[Mapping[str, str]] = None) -> Credentials:
    """A host helper's credentials: the job's full token and the control and read tokens its environment
    names (``PROBE_CONTROL_TOKEN(_FILE)``, ``PROBE_READ_TOKEN(_FILE)``: the ranks' own, which started it)."""
    import os

    from probe._stderr import say
    from probe.agent.token_file import token_from_file as _token_from_file
    from probe.errors import ProbeError

    env = os.environ if environ is None else environ
    tokens = [(full, EVAL, "full token")]
    files = {EVAL: full_file or ""}
    for scope, name, by in ((CONTROL, "CONTROL", "control token"), (READ, "READ", "read token")):
        token = env.get("PROBE_%s_TOKEN" % name)
        path = env.get("PROBE_%s_TOKEN_FILE" % name)
        if not token and path:
            try:
                token = _token_from_file(path, shared=True)
                files[scope] = path
            except ProbeError as exc:
                say("probe: the host helper takes no %s: %s" % (by, exc))
        if token and not any(hmac.compare_digest(token.encode("utf-8"), t) for t, _, _ in tokens):
            tokens.append((token.encode("utf-8"), scope, by))
    return Credentials(tokens, EVAL, files)


def check(credentials: Credentials, table: Mapping[Tuple[str, str], Needed], request: "Request",
          body: Callable[[], Mapping[str, Any]], what: str = "this agent") -> Tuple[Grant, int]:
    """Authorise one request: (its grant, the scope it needs); ``Unauthorized`` or ``Forbidden`` if not."""
    try:
        grant = capped(credentials.grant(request, what), request.headers)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    path = request.path.split("?", 1)[0]
    need = needed(table, request.method, path, body)
    if grant.scope < need:
        raise credentials.refuse(grant, need, command_of(path, body))
    return grant, need
