"""How a request reaches one agent, and what its answer or silence means: the client's plumbing.

:class:`Connection` sends one HTTP request per call (``transport``), over the unix socket of a process on
this host (watched from outside meanwhile: an agent that cannot answer is named within about a second,
``probe.client.outside``) or over TCP (a rank elsewhere, whose host helper says why it is slow,
``probe.client.helped``), and turns the agent's error envelope, or a failed connect, into a probe error
that says what happened to the process (``probe.client.explain``). :class:`probe.client.Client` adds the
operations on top.
"""

import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import probe.client.transport as transport
from probe.client.targets import Target
from probe.errors import AgentBlocked, ProbeError, ProcessDead, UsageError, error_from_code

__all__ = ["Connection", "DEFAULT_TIMEOUT", "read_token", "hand_over"]

DEFAULT_TIMEOUT = 30.0
_GRACE_S = 0.05  # how long a local agent may take before the client looks at its process (= outside.GRACE_S)
_QUEUE_WAIT_S = 0.3  # how long a connect may wait in a full backlog before the client looks at the process
_STALE_S = 0.45  # a heartbeat older than this is worth a look before connecting (= outside.STALE_TRIGGER_S)


class Connection:
    """A connection-less client: each call is one HTTP request to the agent (the operations are
    :class:`probe.client.Client`'s)."""

    _quick = False  # set by backtrace() for its request alone: see _watched
    scope_cap: Optional[str] = None
    """The most this client's requests may do (``read``, ``control``; None: what the token gives), sent as
    ``X-Probe-Scope``: a host helper asking its ranks for a client asks with that client's scope."""

    def __init__(self, target: Target, token: Optional[str] = None, timeout: Optional[float] = None,
                 wait: Optional[float] = None, executable: Optional[str] = None) -> None:
        self.target = target
        self.fixed_timeout = timeout is not None
        """True when the caller chose the wait (``--timeout``): it then bounds every answer, a long query's
        or snippet's too. Otherwise the client waits 30 s, or the agent's own limit on the work and 5 s more."""
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.wait = wait
        """Seconds to wait for a local agent before reading from outside; None: decide quickly (see
        ``probe.client.outside``)."""
        self.executable = executable  # of a core file's process, where the core does not name it
        self.note: Optional[str] = None
        """Set when the last answer did not come from the agent: where it came from, and why."""
        self._token = token
        self._token_sought = token is not None or not target.is_tcp  # see _call
        self._local_queries: Dict[str, Any] = {}  # query_id -> the engine running it here (see interrupt_query)
        self._stopped_early: Dict[str, None] = {}  # query_ids interrupted before they ran here, if they do
        self.helper: Optional[Any] = None
        """A rank's host helper (``probe.client.helped.HostHelper``), asked why the rank is slow to answer."""
        self.remote_pid: Optional[int] = None  # the rank's pid on its host, for its helper

    def __repr__(self) -> str:
        return "<probe.Client %s>" % self.target.label

    # -- plumbing ---------------------------------------------------------------------------------

    def _call(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
              accept: Optional[str] = None, timeout: Optional[float] = None) -> transport.HttpResponse:
        if not self._token_sought:  # HOST:PORT without a token: an agent of ours on this host has it in a file
            from probe.client.local_token import local_token_and_file

            self._token_sought = True
            self._token, self._token_file_left = local_token_and_file(
                self.target.address, ask=self._health_of)  # type: ignore[arg-type]
        headers = {}  # the token goes to transport, which never sends it (probe.client.proof)
        if accept:
            headers["Accept"] = accept
        if self.scope_cap:
            headers["X-Probe-Scope"] = self.scope_cap
        payload = json.dumps(body).encode("utf-8") if body is not None else None
        if self.target.core is not None:
            raise ProcessDead("%s is a core file: it holds stacks only, and nothing runs there" % self.target.label,
                              hint="backtrace and SQL over python.backtrace work on it")
        try:
            if self.target.pid is not None and self.target.is_local:
                response = self._watched(method, path, payload, headers, timeout or self.timeout)
            elif self.helper is not None and self.remote_pid is not None:
                response = self._helped(method, path, payload, headers, timeout or self.timeout)
            else:
                response = transport.request(self.target.address, method, path, payload, headers,
                                             timeout or self.timeout, token=self._token)
        except ProbeError as exc:
            raise self._explain(exc) from None
        if response.status >= 400:
            error = self._error_from(response)
            transport.release(response)
            del response  # the error's traceback holds this frame, not the answer's body
            raise error
        return response

    def _watched(self, method: str, path: str, payload: Optional[bytes], headers: Dict[str, str],
                 timeout: float) -> transport.HttpResponse:
        """A request to a local agent, watched from outside: when the agent cannot answer (a C call holds
        the GIL, the process is stopped) this says so within about a second (``AgentBlocked``, with the
        stacks read from outside) instead of waiting out the timeout.

        A connection the agent cannot accept stays in its listen backlog until it runs again, whether or
        not the client still waits; a hung job probed again and again would fill the backlog (128), and
        then every connect would wait. So an agent already known to be unable to answer (its heartbeat
        stale while a C call holds the GIL, or its process stopped) is not connected to at all, and a
        full backlog is diagnosed at once instead of waited on."""
        import select

        pid, socket_path = self.target.pid, self.target.address.path  # type: ignore[union-attr]
        assert pid is not None
        # A backtrace (the command's, not diagnose's evidence, which names a rank's state) is as good
        # read from outside: the quick rule decides it (probe.client.outside, step 3).
        quick = self._quick and method == "GET" and path == "/v1/backtrace"
        handed = _take_handed(socket_path, method, path, payload, headers)
        age = _heartbeat_age(socket_path)
        if self.wait is None and age > _STALE_S and handed is None:  # its accept thread missed a beat: look
            import probe.client.outside as outside  # before connecting

            early = (outside.known_at_once(pid, socket_path) if age > outside.STALE_HEARTBEAT_S
                     else outside.diagnose_now(pid, socket_path, quick))
            if early is not None and early.state in ("gil_held", "stopped"):
                raise _blocked(early)  # nothing sent, so nothing left queued in the agent
        if handed is not None:
            sock, sent = handed
            sock.settimeout(timeout)
            grace = max(0.0, _GRACE_S - (time.monotonic() - sent))
        else:
            sock = self._connect_watched(method, path, payload, headers, timeout, quick)
            grace = _GRACE_S
        try:
            readable, _, _ = select.select([sock], [], [], grace if self.wait is None else 0)
            if readable:  # the usual case: nothing more to import or look at
                return transport.read_response(sock, self.target.address, timeout)
            import probe.client.outside as outside

            diagnosis = outside.await_answer(sock, pid, socket_path, timeout, self.wait, quick)
        except BaseException:
            sock.close()
            raise
        if diagnosis is not None:
            sock.close()  # the agent sees nobody waits, and runs nothing for this request
            raise _blocked(diagnosis)
        return transport.read_response(sock, self.target.address, timeout)

    def _connect_watched(self, method: str, path: str, payload: Optional[bytes], headers: Dict[str, str],
                         timeout: float, quick: bool = False) -> Any:
        """Connect and send; while the agent's backlog is full, decide from outside (as for a request that
        gets no answer) rather than wait: blocked agents are named at once, slow ones waited for up to
        ``--wait`` or the timeout."""
        pid, socket_path = self.target.pid, self.target.address.path  # type: ignore[union-attr]
        assert pid is not None
        start = time.monotonic()
        limit = timeout if self.wait is None else min(self.wait, timeout)
        while True:
            try:
                return transport.send_request(self.target.address, method, path, payload, headers, timeout,
                                              queue_wait=_QUEUE_WAIT_S, token=self._token)
            except transport.QueueFull:
                pass
            import probe.client.outside as outside

            if self.wait is None:
                diagnosis = outside.diagnose_now(pid, socket_path, quick)
                if diagnosis.state in ("gil_held", "stopped"):
                    raise _blocked(diagnosis) from None
            if time.monotonic() - start >= limit:
                raise _blocked(outside.queue_full(pid, socket_path, time.monotonic() - start,
                                                  "--timeout" if self.wait is None or self.wait >= timeout
                                                  else "--wait")) from None

    def _helped(self, method: str, path: str, payload: Optional[bytes], headers: Dict[str, str],
                timeout: float) -> transport.HttpResponse:
        """A request to a rank elsewhere whose host helper says, when it is slow, whether it cannot answer
        (dead, stopped, GIL held) and sends the stacks it read from outside (see ``probe.client.helped``)."""
        import probe.client.helped as helped
        from probe.errors import ConnectError, Timeout

        helper, pid = self.helper, self.remote_pid
        assert helper is not None and pid is not None
        deadline = time.monotonic() + timeout  # for the whole answer, however it trickles in
        try:
            # A rank that cannot run accepts nothing; once its backlog is full (a hung job probed again and
            # again) a connect waits to its timeout: after a short wait the helper is asked why instead.
            sock = transport.send_request(self.target.address, method, path, payload, headers, timeout,
                                          queue_wait=min(timeout, helped.CONNECT_S), token=self._token)
        except (ConnectError, Timeout) as exc:
            raw = helped.ask(helper, pid)
            error = helped.error_for(raw, helper, self.target.label) if raw is not None else None
            if error is not None:
                raise error from None
            if not isinstance(exc, Timeout) or deadline - time.monotonic() <= 0:
                raise
            sock = transport.send_request(self.target.address, method, path, payload, headers,
                                          max(deadline - time.monotonic(), 0.1), token=self._token)
        try:
            error = helped.await_answer(sock, helper, pid, self.target.label, timeout)
        except BaseException:
            sock.close()
            raise
        if error is not None:
            sock.close()  # the agent sees nobody waits, and runs nothing for this request
            raise error
        return transport.read_response(sock, self.target.address, timeout, deadline)

    def _json(self, method: str, path: str, body: Optional[Dict[str, Any]] = None,
              timeout: Optional[float] = None) -> Dict[str, Any]:
        response = self._call(method, path, body, timeout=timeout)
        status, answer = response.status, _json_body(response)
        del response  # parsed: the error's traceback below must not hold the body
        if not isinstance(answer, dict):
            raise self._not_an_agent("HTTP %d with a body that is not a JSON object" % status)
        return answer

    def _not_an_agent(self, what: str) -> ProbeError:
        """Something answers at the target, but not a probe agent (another HTTP server, a proxy's page)."""
        from probe.errors import ConnectError

        return ConnectError("%s answers, but is not a probe agent (it sent %s)" % (self.target.label, what),
                            hint="check the address and port: an agent serves on the port of PROBE_LISTEN / "
                                 "PROBE_PORT (+ LOCAL_RANK), and `probe list` on its host shows it")

    def _error_from(self, response: transport.HttpResponse) -> ProbeError:
        try:
            error = json.loads(response.body.decode("utf-8"))["error"]
            exc = error_from_code(error.get("code", "internal"), error.get("message", ""), error.get("hint"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return self._not_an_agent("HTTP %d without probe's error envelope" % response.status)
        left = getattr(self, "_token_file_left", None)
        if exc.code == "unauthorized" and not self._token and left:
            # the agent names no file to a TCP caller; this host's own agent named it to us, its owner
            exc.hint = ("the job's token file here, %s, is not a file of yours alone (a link, open to others, or "
                        "gone), so probe did not read it: `chmod 600` it, or pass --token-file" % left)
        elif exc.code == "unauthorized" and not self._token and not exc.hint:
            from probe.client.wording import option

            exc.hint = "pass %s (or set PROBE_TOKEN_FILE)" % option("--token-file FILE", "token_file=")
        return _with_target(exc, self.target.label)

    def _explain(self, exc: ProbeError) -> ProbeError:
        """Turn 'no agent at unix:/tmp/...' into what happened to process PID, and what to do about it."""
        from probe.client.explain import explain

        return explain(self.target, exc)

    def _health_of(self, pid: int, timeout: float) -> Dict[str, Any]:
        """The health the agent in process ``pid`` of this host gives over its unix socket, no fallback."""
        from probe.client.targets import parse_target

        return type(self)(parse_target(str(pid)), timeout=timeout)._json("GET", "/v1/health")

    def _answer_wait(self, limit: Optional[float], agent_default: float) -> float:
        """How long the socket waits: ``--timeout`` when given; else a little longer than the agent's own
        limit on the work (``limit``, or the agent's default), so that the agent's answer arrives first."""
        if self.fixed_timeout:
            return self.timeout
        return max(self.timeout, (limit or agent_default) + 5.0)


def _json_body(response: transport.HttpResponse) -> Any:
    """An answer's JSON (None where it is not JSON); its bytes then stop counting as an answer in flight."""
    try:
        return json.loads(response.body.decode("utf-8"))
    except ValueError:
        return None
    finally:
        transport.release(response)


def _with_target(exc: ProbeError, label: str) -> ProbeError:
    """An agent's texts name its target ``TARGET`` (it cannot know how it was reached): put the target
    the user gave there, so that a command in a hint works as printed."""
    exc.message = exc.message.replace("probe TARGET ", "probe %s " % label)
    if exc.hint:
        exc.hint = exc.hint.replace("probe TARGET ", "probe %s " % label)
    exc.args = (exc.message,)
    return exc


_handed: List[Tuple[str, str, str, Any, float]] = []
"""A request ``probe.cli.quick`` sent and got no answer to within its grace time: (socket path, method, path,
the socket, when it was sent), for the request of this command to the same agent to go on from."""


def hand_over(sock: Any, socket_path: str, method: str, path: str) -> None:
    """Leave the request ``method path`` (no body, no header of the caller's), sent on ``sock`` (a connected
    ``_socket.socket``) to the agent at ``socket_path``, to this command's request of the same: its watch of
    the process, and the reading of its answer, go on from there, as if it had sent it."""
    import socket

    _handed.append((socket_path, method, path, socket.socket(fileno=sock.detach()), time.monotonic()))


def _take_handed(socket_path: str, method: str, path: str, payload: Optional[bytes],
                 headers: Dict[str, str]) -> Optional[Tuple[Any, float]]:
    """The socket handed over for this very request, and when it was sent; None where there is none (any
    other socket handed over is closed: the agent sees nobody waits, and runs nothing for it)."""
    found = None
    while _handed:
        where, verb, what, sock, sent = _handed.pop()
        if found is None and (where, verb, what) == (socket_path, method, path) and not payload and not headers:
            found = (sock, sent)
        else:
            sock.close()
    return found


def _heartbeat_age(socket_path: str) -> float:
    """Seconds since the agent's accept thread last touched its socket (0 where that cannot be told)."""
    try:
        return max(0.0, time.time() - os.stat(socket_path).st_mtime)
    except OSError:
        return 0.0


def _blocked(diagnosis: Any) -> AgentBlocked:
    exc = AgentBlocked(diagnosis.message, diagnosis.hint)
    exc.diagnosis = diagnosis  # type: ignore[attr-defined]
    return exc



def read_token(token: Optional[str], token_file: Optional[str]) -> Optional[str]:
    """The token given, else the one in ``token_file`` or $PROBE_TOKEN_FILE, else $PROBE_TOKEN."""
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

