"""The client of one agent: every operation the CLI offers, as a method.

``query`` returns a ``pyarrow.Table``; ``query_rows`` returns plain rows without importing pyarrow (the
CLI uses it to stay fast). Where the agent cannot run SQL itself (its process cannot import DuckDB or
pyarrow), the client fetches the tables the query names and runs the query here, in the same
locked-down engine.
"""

import json
import os
import time
from typing import Any, Dict, List, Optional

from probe import _paths
from probe.client import transport
from probe.client.results import EvalResult, Frame, Rows, TableInfo
from probe.client.targets import Target, parse_target
from probe.errors import ProbeError, SQLUnavailable, UsageError, error_from_code

__all__ = ["Client", "connect", "ARROW_STREAM"]

ARROW_STREAM = "application/vnd.apache.arrow.stream"
DEFAULT_TIMEOUT = 30.0


class Client:
    """A connection-less client: each call is one HTTP request to the agent."""

    def __init__(self, target: Target, token: Optional[str] = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.target = target
        self.timeout = timeout
        self._token = token
        self._local_sql = False  # set once the agent said it cannot run SQL itself

    def __repr__(self) -> str:
        return "<probe.Client %s>" % self.target.label

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
              accept: Optional[str] = None, timeout: Optional[float] = None) -> transport.HttpResponse:
        headers = {}
        if self._token:
            headers["Authorization"] = "Bearer %s" % self._token
        if accept:
            headers["Accept"] = accept
        payload = json.dumps(body).encode("utf-8") if body is not None else None
        try:
            response = transport.request(self.target.address, method, path, payload, headers,
                                         timeout or self.timeout)
        except ProbeError as exc:
            raise self._explain(exc) from None
        if response.status >= 400:
            raise self._error_from(response)
        return response

    def _json(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
              timeout: Optional[float] = None) -> Dict[str, Any]:
        response = self._call(method, path, body, timeout=timeout)
        try:
            return json.loads(response.body.decode("utf-8"))
        except ValueError:
            raise ProbeError("%s sent an answer that is not JSON" % self.target.label) from None

    def _error_from(self, response: transport.HttpResponse) -> ProbeError:
        try:
            error = json.loads(response.body.decode("utf-8"))["error"]
            exc = error_from_code(error.get("code", "internal"), error.get("message", ""), error.get("hint"))
        except (ValueError, KeyError, TypeError, AttributeError):
            exc = error_from_code("internal", "HTTP %d from %s" % (response.status, self.target.label))
        if exc.code == "unauthorized" and not self._token and not exc.hint:
            exc.hint = "pass --token-file FILE (or set PROBE_TOKEN_FILE)"
        return exc

    def _explain(self, exc: ProbeError) -> ProbeError:
        """Turn 'no agent at unix:/tmp/...' into what happened to process PID, and what to do about it."""
        from probe.errors import ConnectError

        if not isinstance(exc, ConnectError) or self.target.pid is None:
            return exc
        pid = self.target.pid
        path = getattr(self.target.address, "path", None) or _paths.socket_path(pid)
        # transport raises ConnectError from the OSError of the failed step (kept as __context__); a
        # ConnectError without one, or from a reset or broken pipe, means the connection was made and
        # then dropped: the agent was answering.
        cause = exc.__context__
        answering = cause is None or isinstance(cause, (ConnectionResetError, BrokenPipeError))
        state = _process_state(pid, wait=0.5 if answering else 0.0)
        if answering and state in ("gone", "zombie"):
            return ConnectError("process %d died while answering (it exited or was killed)%s"
                                % (pid, _zombie_note(pid) if state == "zombie" else ""),
                                hint="its exit status, or the kernel log (OOM killer), may say why")
        if os.path.dirname(path) == _paths.runtime_dir():
            problem = _paths.runtime_dir_problem()
            if problem:
                return ConnectError(problem[0] + "; no agent uses it", hint=problem[1])
        socket_state = _paths.socket_state(path)
        refused = socket_state == "refused"
        if state == "zombie":
            return ConnectError("process %d has exited%s" % (pid, _zombie_note(pid)),
                                hint="nothing runs there to answer; its parent must reap it (wait for it)")
        if state == "gone":
            if refused:
                return ConnectError("process %d is gone (it exited or was killed) and left its agent's socket %s"
                                    % (pid, path), hint="`probe list` removes such leftovers")
            return ConnectError("no process with pid %d (it exited, was killed, or never was)" % pid,
                                hint="check the pid with `probe list` or ps")
        if refused:
            return ConnectError("no agent listens in process %d: its socket %s refuses connections (its agent "
                                "stopped, or an earlier process with this pid died and left it)" % (pid, path),
                                hint="start an agent in it with `probe %d inject`" % pid)
        if answering or socket_state != "missing":
            return exc  # what transport said is all there is to say (permission denied, a dropped answer)
        return ConnectError("no agent in process %d" % pid,
                            hint="start it with PROBE=1 in the process's environment, or `probe %d inject`" % pid)

    # -- operations -------------------------------------------------------------------------------

    def health(self) -> Dict[str, Any]:
        """Who the agent is: pid, host, rank, world size, python, probe version, capabilities."""
        return self._json("GET", "/v1/health")

    def tables(self) -> List[TableInfo]:
        return [TableInfo.from_json(t) for t in self._json("GET", "/v1/tables")["tables"]]

    def schema(self, name: str) -> TableInfo:
        return TableInfo.from_json(self._json("GET", "/v1/tables/%s" % name))

    def table_rows(self, name: str) -> Rows:
        """Every row of one table, as the agent produces it (no SQL involved)."""
        raw = self._json("POST", "/v1/rows", {"table": name})
        return Rows(tuple((c["name"], c["type"]) for c in raw["columns"]), raw["rows"], False)

    def backtrace(self) -> List[Frame]:
        """Every thread's stack, innermost frame first within each thread (the rows of python.backtrace)."""
        raw = self._json("GET", "/v1/backtrace")
        frames = raw["frames"]
        out = []
        for thread_id, name, native_id, is_main, chain in raw["threads"]:
            for depth, position in enumerate(chain):
                func, file, lineno, code = frames[position]
                out.append(Frame(thread_id, name, native_id, bool(is_main), depth, func, file, lineno, code))
        return out

    def query_rows(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None) -> Rows:
        """Run SQL; the result as plain rows (no pyarrow needed when the agent runs the query)."""
        if not self._local_sql:
            body = _query_body(sql, max_rows, timeout)
            try:
                raw = self._json("POST", "/v1/query", body, timeout=_wait_for(timeout, self.timeout))
                return Rows(tuple((c["name"], c["type"]) for c in raw["columns"]), raw["rows"],
                            bool(raw.get("truncated")))
            except SQLUnavailable:
                self._local_sql = True
        from probe.client.local_sql import rows_of

        return rows_of(self.query(sql, max_rows=max_rows, timeout=timeout))

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None) -> Any:
        """Run SQL; the result as a ``pyarrow.Table`` (metadata ``probe.truncated`` says if it was cut)."""
        if not self._local_sql:
            try:
                return self._query_arrow(sql, max_rows, timeout)
            except SQLUnavailable:
                self._local_sql = True
        from probe.client.local_sql import run_locally

        return run_locally(self, sql, max_rows, timeout)

    def _query_arrow(self, sql: str, max_rows: Optional[int], timeout: Optional[float]) -> Any:
        import pyarrow as pa

        response = self._call("POST", "/v1/query", _query_body(sql, max_rows, timeout), accept=ARROW_STREAM,
                              timeout=_wait_for(timeout, self.timeout))
        if not response.headers.get("content-type", "").startswith(ARROW_STREAM):
            raise ProbeError("%s did not answer in Arrow" % self.target.label)
        return pa.ipc.open_stream(response.body).read_all()

    def eval(self, code: str, timeout: Optional[float] = None) -> EvalResult:
        """Run ``code`` in the target's ``__main__``; printed output, final value and any traceback."""
        body: Dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout"] = timeout
        raw = self._json("POST", "/v1/eval", body, timeout=_wait_for(timeout, self.timeout))
        return EvalResult(raw.get("stdout", ""), raw.get("stderr", ""), raw.get("value"), raw.get("error"),
                          bool(raw.get("timed_out")))



def _process_state(pid: int, wait: float = 0.0) -> str:
    """``"gone"``, ``"zombie"`` (exited, not reaped by its parent) or ``"alive"``, from /proc/PID/stat.

    With ``wait``, an alive process is looked at again for up to that many seconds: a process that is
    dying closes its sockets a moment before /proc shows it exited.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            with open("/proc/%d/stat" % pid, "rb") as handle:
                stat = handle.read()
            # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses; STATE follows the last ')'.
            state = "zombie" if stat[stat.rindex(b")") + 2:][:1] in (b"Z", b"X") else "alive"
        except (OSError, ValueError):
            state = "gone"
        if state != "alive" or time.monotonic() >= deadline:
            return state
        time.sleep(0.02)


def _zombie_note(pid: int) -> str:
    """", and its parent (pid P, NAME) has not reaped it" for a zombie; "" when /proc does not say."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as handle:
            stat = handle.read()
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        with open("/proc/%d/comm" % ppid, "rb") as handle:
            name = handle.read().decode("utf-8", "replace").strip()
    except (OSError, ValueError, IndexError):
        return ", and its parent has not reaped it"
    return ", and its parent (pid %d, %s) has not reaped it" % (ppid, name)


def _query_body(sql: str, max_rows: Optional[int], timeout: Optional[float]) -> Dict[str, Any]:
    body: Dict[str, Any] = {"sql": sql}
    if max_rows is not None:
        body["max_rows"] = max_rows
    if timeout is not None:
        body["timeout"] = timeout
    return body


def _wait_for(request_timeout: Optional[float], default: float) -> float:
    """How long the socket waits: a little longer than the agent's own limit, so its error arrives."""
    return max(default, (request_timeout or 0) + 5.0)


def _read_token(token: Optional[str], token_file: Optional[str]) -> Optional[str]:
    if token:
        return token
    token_file = token_file or os.environ.get("PROBE_TOKEN_FILE")
    if token_file:
        try:
            with open(token_file) as handle:
                return handle.read().strip() or None
        except OSError as exc:
            raise UsageError("cannot read the token file %s: %s" % (token_file, exc.strerror)) from None
    return os.environ.get("PROBE_TOKEN") or None


def connect(target: Optional[str] = None, token: Optional[str] = None, token_file: Optional[str] = None,
            timeout: float = DEFAULT_TIMEOUT) -> Client:
    """A client of the agent at ``target`` (a pid, ``host:port``, ``unix:PATH``; default ``$PROBE_TARGET``).

    For TCP, the token comes from ``token``, ``token_file``, ``$PROBE_TOKEN_FILE`` or ``$PROBE_TOKEN``.
    No request is sent until the first call.
    """
    target = target if target is not None else os.environ.get("PROBE_TARGET")
    if not target:
        raise UsageError("no target given", hint="give a pid, HOST:PORT or unix:PATH, or set PROBE_TARGET")
    return Client(parse_target(str(target)), _read_token(token, token_file), timeout)
