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
from probe.errors import AgentBlocked, ProbeError, ProcessDead, SQLUnavailable, UsageError, error_from_code

__all__ = ["Client", "connect", "ARROW_STREAM"]

ARROW_STREAM = "application/vnd.apache.arrow.stream"
DEFAULT_TIMEOUT = 30.0
_GRACE_S = 0.05  # how long a local agent may take before the client looks at its process (= outside.GRACE_S)
_QUEUE_WAIT_S = 0.3  # how long a connect may wait in a full backlog before the client looks at the process
_STALE_S = 0.45  # a heartbeat older than this is worth a look before connecting (= outside.STALE_TRIGGER_S)


class Client:
    """A connection-less client: each call is one HTTP request to the agent."""

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
            from probe.client.discovery import local_token_and_file

            self._token_sought = True
            self._token, self._token_file_left = local_token_and_file(self.target.address)  # type: ignore[arg-type]
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
        age = _heartbeat_age(socket_path)
        if self.wait is None and age > _STALE_S:  # its accept thread missed a beat: look before connecting
            from probe.client import outside

            early = (outside.known_at_once(pid, socket_path) if age > outside.STALE_HEARTBEAT_S
                     else outside.diagnose_now(pid, socket_path, quick))
            if early is not None and early.state in ("gil_held", "stopped"):
                raise _blocked(early)  # nothing sent, so nothing left queued in the agent
        sock = self._connect_watched(method, path, payload, headers, timeout, quick)
        try:
            readable, _, _ = select.select([sock], [], [], _GRACE_S if self.wait is None else 0)
            if readable:  # the usual case: nothing more to import or look at
                return transport.read_response(sock, self.target.address, timeout)
            from probe.client import outside

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
            from probe.client import outside

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
        from probe.client import helped
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
        if state in ("gone", "zombie"):
            dead = _dead_with_record(pid, answering)
            if dead is not None and dead.record.has_stacks:  # type: ignore[attr-defined]
                if state == "zombie":
                    dead.message += _zombie_note(pid)
                return dead
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
                return ConnectError("process %d is gone (it exited or was killed) and left its agent's socket %s%s"
                                    % (pid, path, "; no handler could run (SIGTERM, SIGKILL, the OOM killer, os._exit)"
                                       if dead is not None else ""), hint="`probe list` removes such leftovers")
            return ConnectError("no process with pid %d (it exited, was killed, or never was)" % pid,
                                hint="check the pid with `probe list` or ps")
        from probe.injector.advice import another_users

        foreign = another_users(pid)  # its /proc files and its agent's directory are closed to us
        if foreign is not None:
            return foreign
        if refused:
            return _agentless_advice(pid, path, "no agent listens in process %d: its socket %s refuses connections "
                                     "(its agent stopped, or an earlier process with this pid died and left it)"
                                     % (pid, path))
        if answering or socket_state != "missing":
            return exc  # what transport said is all there is to say (permission denied, a dropped answer)
        not_python = _not_python(pid)
        if not_python:
            return ConnectError("process %d (%s) is not a Python interpreter, so no agent can run in it" % (pid, not_python),
                                hint="give the pid of the Python process itself (`probe list` shows them)")
        return _agentless_advice(pid, path, "no agent in process %d" % pid)

    # -- operations -------------------------------------------------------------------------------

    def health(self, fallback: bool = True) -> Dict[str, Any]:
        """Who the agent is: pid, host, rank, world size, python, probe version, capabilities.

        Where the agent cannot answer (GIL held, stopped, dead, a core file) the answer says so instead
        (unless ``fallback`` is False: then the error is raised): ``state`` and ``agent`` keys, and who
        holds the GIL where that is known.
        """
        self.note = None
        try:
            return self._json("GET", "/v1/health")
        except ProbeError as exc:
            if not fallback:
                raise
            stacks = _outside_stacks(exc)
            if stacks is None and self.target.core is None:
                raise
            if self.target.core is not None:
                stacks = self._read_core(False)
            return _health_from_outside(self.target, exc, stacks)

    def tables(self) -> List[TableInfo]:
        return [TableInfo.from_json(t) for t in self._json("GET", "/v1/tables")["tables"]]

    def schema(self, name: str) -> TableInfo:
        return TableInfo.from_json(self._json("GET", "/v1/tables/%s" % name))

    def table_rows(self, name: str, max_rows: Optional[int] = None, columns: Optional[List[str]] = None) -> Rows:
        """Every row of one table, as the agent produces it (no SQL involved); at most ``max_rows`` (an
        agent caps it at its own ceiling): ``truncated`` says the table had more. ``columns``: only those
        of these names (at least one column comes)."""
        body: Dict[str, Any] = {"table": name}
        if max_rows is not None:
            body["max_rows"] = max_rows
        if columns is not None:
            body["columns"] = columns
        raw = self._json("POST", "/v1/rows", body)
        return Rows(tuple((c["name"], c["type"]) for c in raw["columns"]), raw["rows"], bool(raw.get("truncated")))

    def backtrace(self, native: bool = False) -> List[Frame]:
        """Every thread's stack, innermost frame first within each thread (the rows of python.backtrace).

        From the agent when it can answer; otherwise read from outside the process (GIL held, stopped),
        from its crash record (dead), or from a core file, and ``note`` says so. ``native`` adds the C
        frames, read from outside (a process on this host; it is stopped for tens of milliseconds).
        """
        self.note = None
        if self.target.core is not None or native:
            return _frames_of(self._outside(native))
        try:
            self._quick = True
            try:
                raw = self._json("GET", "/v1/backtrace")
            finally:
                self._quick = False
        except ProbeError as exc:
            stacks = _outside_stacks(exc, agentless=True)
            if stacks is None:
                raise
            self.note = _note_for(exc, stacks)
            return _frames_of(stacks)
        frames = raw["frames"]
        out = []
        for thread_id, name, native_id, is_main, chain in raw["threads"]:
            for depth, position in enumerate(chain):
                func, file, lineno, code = frames[position]
                out.append(Frame(thread_id, name, native_id, bool(is_main), depth, func, file, lineno, code))
        return out

    def _outside(self, native: bool) -> Any:
        """The stacks read from outside: a core file, or a live process on this host."""
        if self.target.core is not None:
            stacks = self._read_core(native)
            self.note = "read from %s" % stacks.source
            return stacks
        from probe.client.same_host import same_host_pid

        pid = self.target.pid if self.target.is_local else same_host_pid(self.target, self.remote_pid)
        if pid is None:
            raise UsageError("native frames are read from outside the process, which needs it on this host",
                             hint="run probe on %s's host" % self.target.label)
        from probe.reader import live

        if _process_state(pid) != "alive":
            dead = _dead_with_record(pid)
            if dead is not None:
                raise dead
        else:
            from probe.injector.advice import another_users

            foreign = another_users(pid)
            if foreign is not None:
                raise foreign
        stacks = live.read_live(pid, native=native)
        self.note = "stacks %s" % stacks.source
        return stacks

    def _read_core(self, native: bool) -> Any:
        from probe.reader import pystack_source

        assert self.target.core is not None
        return pystack_source.read_core(self.target.core, self.executable, native)

    def query_rows(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
                   native: bool = False, query_id: Optional[str] = None) -> Rows:
        """Run SQL; the result as plain rows (no pyarrow needed when the agent runs the query).

        Where the agent cannot answer, SQL over ``python.backtrace`` still runs, here, on the stacks
        read from outside (``note`` says so); ``native`` makes that table hold the C frames too.
        ``query_id`` names the query for :meth:`interrupt_query`.
        """
        from probe.client.local_sql import rows_of

        self.note = None
        if self.target.core is not None or native:
            return rows_of(self._sql_on_stacks(sql, self._outside(native), max_rows, timeout, None))
        body = _query_body(sql, max_rows, timeout, query_id)
        try:
            raw = self._json("POST", "/v1/query", body, timeout=self._answer_wait(timeout, 10.0))
            return Rows(tuple((c["name"], c["type"]) for c in raw["columns"]), raw["rows"],
                        bool(raw.get("truncated")), (raw.get("limits") or {}).get("max_rows"))
        except SQLUnavailable:
            pass  # asked again next time: the agent may run SQL itself later (its program imported DuckDB)
        except ProbeError as exc:
            stacks = _outside_stacks(exc, agentless=True)
            if stacks is None:
                raise
            self.note = _note_for(exc, stacks)
            return rows_of(self._sql_on_stacks(sql, stacks, max_rows, timeout, exc))
        return rows_of(self._run_locally(sql, max_rows, timeout, query_id))

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
              native: bool = False, query_id: Optional[str] = None) -> Any:
        """Run SQL; the result as a ``pyarrow.Table`` (metadata ``probe.truncated`` says if it was cut).

        Falls back to the stacks read from outside as ``query_rows`` does."""
        self.note = None
        if self.target.core is not None or native:
            return self._sql_on_stacks(sql, self._outside(native), max_rows, timeout, None)
        try:
            return self._query_arrow(sql, max_rows, timeout, query_id)
        except SQLUnavailable:
            pass  # asked again next time, as in query_rows
        except ProbeError as exc:
            stacks = _outside_stacks(exc, agentless=True)
            if stacks is None:
                raise
            self.note = _note_for(exc, stacks)
            return self._sql_on_stacks(sql, stacks, max_rows, timeout, exc)
        return self._run_locally(sql, max_rows, timeout, query_id)

    def _run_locally(self, sql: str, max_rows: Optional[int], timeout: Optional[float],
                     query_id: Optional[str]) -> Any:
        """The query run here over the rows of the tables it names: the agent leaves DuckDB out of its
        process (or cannot import it). ``note`` says where it ran, and which table the agent cut."""
        from probe.client.local_sql import run_locally

        return run_locally(self, sql, max_rows, timeout, query_id)

    def _sql_on_stacks(self, sql: str, stacks: Any, max_rows: Optional[int], timeout: Optional[float],
                       why: Optional[ProbeError]) -> Any:
        from probe.client.local_sql import run_on_stacks

        return run_on_stacks(sql, stacks, max_rows, timeout, why, self.target.label)

    def interrupt_query(self, query_id: str) -> str:
        """Stop the query sent with ``query_id`` in the agent: ``interrupted``, ``finished`` (it had
        ended) or ``cancelled`` (it had not started: it will stop when it does)."""
        engine = self._local_queries.get(query_id)
        if engine is not None:  # run here, over the agent's rows
            return str(engine.interrupt(query_id))
        state = str(self._json("POST", "/v1/query/interrupt", {"id": query_id}, timeout=5.0).get("state"))
        if state == "finished":  # not in the agent: it may yet run here (an interrupt can overtake its query)
            self._stopped_early[query_id] = None
            while len(self._stopped_early) > 64:
                self._stopped_early.pop(next(iter(self._stopped_early)))
            engine = self._local_queries.get(query_id)
            if engine is not None:
                return str(engine.interrupt(query_id))
        return state

    def _query_arrow(self, sql: str, max_rows: Optional[int], timeout: Optional[float],
                     query_id: Optional[str] = None) -> Any:
        import pyarrow as pa

        response = self._call("POST", "/v1/query", _query_body(sql, max_rows, timeout, query_id), accept=ARROW_STREAM,
                              timeout=self._answer_wait(timeout, 10.0))
        try:
            if not response.headers.get("content-type", "").startswith(ARROW_STREAM):
                raise ProbeError("%s did not answer in Arrow" % self.target.label)
            return pa.ipc.open_stream(response.body).read_all()
        finally:
            transport.release(response)  # read: no longer an answer in flight

    def eval(self, code: str, timeout: Optional[float] = None, on: str = "agent", frame: Optional[str] = None,
             wait: Optional[float] = None, eval_id: Optional[str] = None, origin: Optional[str] = None) -> EvalResult:
        """Run ``code`` in the target's ``__main__``; printed output, final value (``value``: its ``repr()``, a
        string, see :class:`EvalResult`) and any traceback.

        ``on``: ``"agent"`` (the agent's own thread, concurrent with the program), ``"main"`` (the main
        thread, which waits while it runs) or ``"step"`` (right after the next optimizer step); ``wait``
        bounds the wait for that thread. ``frame``: ``"THREAD:DEPTH"`` evaluates in that frame's
        namespace. ``eval_id`` names the run for :meth:`interrupt_eval`. ``origin``: what the target's audit
        trail calls the command (``"repl"``; default ``eval``).
        """
        body: Dict[str, Any] = {"code": code}
        if timeout is not None:
            body["timeout"] = timeout
        if on != "agent":
            body["on"] = on
        for key, value in (("frame", frame), ("wait", wait), ("id", eval_id), ("origin", origin)):
            if value is not None:
                body[key] = value
        socket_wait = self._answer_wait(timeout, 30.0)
        if on != "agent" and not self.fixed_timeout:
            socket_wait = max(socket_wait, (wait or (10.0 if on == "main" else 60.0)) + (timeout or 30.0) + 5.0)
        raw = self._json("POST", "/v1/eval", body, timeout=socket_wait)
        return EvalResult(raw.get("stdout", ""), raw.get("stderr", ""), raw.get("value"), raw.get("error"),
                          bool(raw.get("timed_out")), raw.get("limits"))

    def _answer_wait(self, limit: Optional[float], agent_default: float) -> float:
        """How long the socket waits: ``--timeout`` when given; else a little longer than the agent's own
        limit on the work (``limit``, or the agent's default), so that the agent's answer arrives first."""
        if self.fixed_timeout:
            return self.timeout
        return max(self.timeout, (limit or agent_default) + 5.0)

    def interrupt_eval(self, eval_id: str) -> str:
        """Interrupt the snippet sent with ``eval_id``: ``interrupted`` (it ended), ``stopping`` (it is inside a
        call into C, which the interrupt cannot enter: it stops when the call returns), ``finished``, or
        ``cancelled`` (it had not started, or not arrived: it will not run)."""
        return str(self.interrupt_eval_detail(eval_id).get("state"))

    def interrupt_eval_detail(self, eval_id: str) -> Dict[str, Any]:
        """As :meth:`interrupt_eval`, with ``where`` (the snippet's innermost Python line) when ``stopping``."""
        return self._json("POST", "/v1/eval/interrupt", {"id": eval_id})

    def complete(self, text: str, frame: Optional[str] = None) -> List[str]:
        """Completions of a name or dotted attribute in the target's ``__main__`` (or ``frame``)."""
        body: Dict[str, Any] = {"text": text}
        if frame is not None:
            body["frame"] = frame
        return [str(m) for m in self._json("POST", "/v1/complete", body).get("matches", [])]

    def debug_start(self, host: str = "127.0.0.1", port: int = 5678, insecure: bool = False,
                    window: Optional[float] = None) -> Dict[str, Any]:
        """Start debugpy in the target, listening on ``host:port``; where it listens.

        It admits only connections from the target's user (or root) on its host; a host other than a
        loopback address needs ``insecure``. It stops by itself when no IDE has been attached for
        ``window`` seconds (the agent's default: 600). On this host, a target whose environment lacks
        debugpy gets this process's copy.
        """
        from probe.client.debugpy_dir import exposure_dir

        body: Dict[str, Any] = {"host": host, "port": port, "insecure": insecure}
        if window is not None:
            body["window_s"] = window
        if self.target.pid is not None or getattr(self.target.address, "path", None):
            body["import_dir"] = exposure_dir()
        return self._json("POST", "/v1/debug/start", body, timeout=max(self.timeout, 60.0))

    def debug_stop(self) -> Dict[str, Any]:
        """Stop debugpy in the target."""
        return self._json("POST", "/v1/debug/stop", {})

    def checkpoint(self, path: str, models: Optional[List[str]] = None, optimizers: Optional[List[str]] = None,
                   timeout: float = 300.0, concurrent: bool = False, frame: Optional[str] = None,
                   format: str = "probe", overwrite: bool = False, save_id: Optional[str] = None) -> Dict[str, Any]:
        """Save the target's models, optimizers, schedulers, trainer progress and RNG states to ``path`` (in
        the target's file system; ``{rank}`` becomes its rank), atomically. ``models``/``optimizers``:
        expressions in ``__main__`` (or in ``frame``, THREAD:DEPTH, or where the program's frames define
        them); default: those the agent finds. ``format``: probe (one file), hf (a directory transformers'
        Trainer resumes from) or lightning. Written between two optimizer steps when the job makes steps
        (else, or with ``concurrent``, alongside the loop). An existing ``path`` is replaced only with
        ``overwrite`` and only when it is a checkpoint; a symbolic link there never. Returns the path,
        bytes, sha256, what the file holds, and ``taken``: how it was taken. ``save_id``: the same for
        every rank of one save to one hf directory (made fresh where not given)."""
        body: Dict[str, Any] = {"path": path, "timeout": timeout, "concurrent": concurrent}
        if frame is not None:
            body["frame"] = frame
        if format != "probe":
            body["format"] = format
        if overwrite:
            body["overwrite"] = True
        if format == "hf":
            import secrets

            body["save_id"] = save_id or secrets.token_hex(8)
        if models:
            body["models"] = list(models)
        if optimizers:
            body["optimizers"] = list(optimizers)
        return self._json("POST", "/v1/torch/checkpoint", body, timeout=self._answer_wait(timeout, timeout))

    def trace(self, action: str, **options: Any) -> Dict[str, Any]:
        """Control the target's torch trace: ``action`` is start, stop, status or export.

        ``start`` takes ``every``, ``modules`` (a glob), ``backward``, ``anomalies``, ``size``; every action
        answers the trace's status, except ``export``, which answers Chrome trace-event JSON.
        """
        body: Dict[str, Any] = {"action": action}
        body.update({k: v for k, v in options.items() if v is not None})
        return self._json("POST", "/v1/torch/trace", body)

    def trace_start(self, every: Optional[int] = None, modules: Optional[str] = None, backward: Optional[bool] = None,
                    anomalies: Optional[bool] = None, size: Optional[int] = None) -> Dict[str, Any]:
        return self.trace("start", every=every, modules=modules, backward=backward, anomalies=anomalies, size=size)

    def trace_stop(self) -> Dict[str, Any]:
        return self.trace("stop")

    def trace_status(self) -> Dict[str, Any]:
        return self.trace("status")

    def trace_export(self) -> Dict[str, Any]:
        """The trace as Chrome trace-event JSON (``{"traceEvents": [...]}``; pid = rank, tid = thread)."""
        return self.trace("export")



def _json_body(response: transport.HttpResponse) -> Any:
    """An answer's JSON (None where it is not JSON); its bytes then stop counting as an answer in flight."""
    try:
        return json.loads(response.body.decode("utf-8"))
    except ValueError:
        return None
    finally:
        transport.release(response)


def _agentless(exc: ProbeError, pid: int) -> ProbeError:
    """Mark an error about a live local process that runs no agent: its stacks can still be read from outside."""
    exc.agentless_pid = pid  # type: ignore[attr-defined]
    return exc


def _agentless_advice(pid: int, path: str, message: str) -> ProbeError:
    """The error for a live local Python process of ours with no agent at ``path``: ``message``, with the
    next step that works for this process (see ``probe.injector.advice``): an old Python gets none (its
    stacks are read from outside), torchrun's launcher its job's ``ranks`` command, an agent in another
    runtime directory its socket, a C call that keeps the GIL the news that no agent can start before
    it returns, ``PROBE=1`` under an interpreter without probe that fact; else PROBE=1 or inject."""
    from probe.errors import ConnectError, ReaderError
    from probe.injector import advice

    inject = "`probe %d inject`" % pid
    outside = "its stacks are read from outside: `probe %d backtrace` (SQL over python.backtrace works too)" % pid
    version = advice.old_python(pid)
    if version is not None:
        return _agentless(ConnectError("%s, and none can run there: it runs Python %d.%d, and probe's agent needs "
                                       "%d.%d or newer" % ((message,) + version + advice.MIN_VERSION), hint=outside), pid)
    launcher = advice.launcher_advice(pid)
    if launcher is not None:
        return _agentless(ConnectError(launcher[0], hint=launcher[1]), pid)
    elsewhere = advice.agent_elsewhere(pid, path)
    if elsewhere is not None:
        return _agentless(ConnectError("%s at %s: its own environment (another PROBE_RUNTIME_DIR or XDG_RUNTIME_DIR) "
                                       "puts its agent's socket at %s" % ("no agent in process %d" % pid, path, elsewhere),
                                       hint="`%s`" % advice.command_line(pid, target="unix:" + elsewhere)), pid)
    from probe.reader import live

    try:
        stacks = live.read_live(pid) if live.available() else None
    except ReaderError:
        stacks = None
    holder = advice.gil_kept_in_c(pid, stacks)
    requested = advice.probe_requested(pid)
    if holder is not None:
        exc = ConnectError("%s, and none can start now: thread %s holds the GIL in %s inside a call into C that does "
                           "not let go; an agent needs the GIL to start, so injecting one cannot work until that call "
                           "returns" % (message, holder.label().strip(), holder.where()),
                           hint="%s; `probe %d backtrace --native` shows the C frames" % (outside, pid))
    elif requested is not None and advice.forked_from(pid) is not None:
        parent = advice.forked_from(pid)
        exc = ConnectError("%s: it was forked from process %s, which runs an agent, and an agent does not follow a "
                           "fork (%s in its environment is its parent's)" % (message, parent, requested),
                           hint="%s starts one in it (a DataLoader worker is also listed by its parent: `probe %s "
                                "query \"SELECT * FROM python.workers\"`)" % (inject, parent))
    elif requested is not None:
        installed, exe = advice.autostart_installed(pid)
        if installed is False:
            exc = ConnectError("%s: %s is set in its environment, but probe is not installed for its interpreter "
                               "%s, so nothing started an agent" % (message, requested, exe),
                               hint="%s starts one now; for %s to work, install probe for that interpreter: %s"
                                    % (inject, requested, advice.install_hint(exe)))
        else:
            exc = ConnectError("%s, although %s is set in its environment (started with python -S or -I, or the "
                               "agent failed: its stderr says why in a line that starts with 'probe:')"
                               % (message, requested), hint="%s starts one now" % inject)
    else:
        exc = ConnectError(message, hint="%s starts one now (or start the program with PROBE=1 in its environment)"
                                         % inject)
    exc = _agentless(exc, pid)
    exc.outside = stacks  # type: ignore[attr-defined]  # read once: backtrace and SQL use them
    return exc


def _with_target(exc: ProbeError, label: str) -> ProbeError:
    """An agent's texts name its target ``TARGET`` (it cannot know how it was reached): put the target
    the user gave there, so that a command in a hint works as printed."""
    exc.message = exc.message.replace("probe TARGET ", "probe %s " % label)
    if exc.hint:
        exc.hint = exc.hint.replace("probe TARGET ", "probe %s " % label)
    exc.args = (exc.message,)
    return exc


def _outside_stacks(exc: ProbeError, agentless: bool = False) -> Any:
    """The stacks that came with an error: read from outside (agent blocked), a crash record (dead), or
    with ``agentless``, read now from a live process that runs no agent (None where that fails)."""
    pid = getattr(exc, "agentless_pid", None)
    if agentless and getattr(exc, "outside", None) is not None:
        return exc.outside  # type: ignore[attr-defined]
    if agentless and pid is not None:
        from probe.errors import ReaderError
        from probe.reader import live

        try:
            return live.read_live(pid)
        except ReaderError:
            return None
    diagnosis = getattr(exc, "diagnosis", None)
    if diagnosis is not None and diagnosis.stacks is not None:
        return diagnosis.stacks
    record = getattr(exc, "record", None)
    if record is not None and record.has_stacks:
        return record.stacks()
    return None


def _note_for(exc: ProbeError, stacks: Any) -> str:
    """Why the agent did not answer, and where the stacks shown come from (the CLI prints it on stderr)."""
    if isinstance(exc, ProcessDead):
        return "%s; these are its last stacks, from its %s" % (exc.message, stacks.source)
    return "%s\n  %s\n  stacks %s" % (exc.message, exc.hint or "", stacks.source)


def _frames_of(stacks: Any) -> List[Frame]:
    return [Frame(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], code=r[9], frame_type=r[8]) for r in stacks.rows()]


def _health_from_outside(target: Target, exc: ProbeError, stacks: Any) -> Dict[str, Any]:
    """What health can say when the agent cannot: the process's state and who holds the GIL."""
    diagnosis = getattr(exc, "diagnosis", None)
    record = getattr(exc, "record", None)
    holder = stacks.gil_holder() if stacks is not None else None
    out: Dict[str, Any] = {"pid": stacks.pid if stacks is not None else target.pid, "agent": "unavailable",
                           "why": exc.message, "hint": exc.hint}
    if target.core is not None:
        out.update(state="core file", source=stacks.source, signal=stacks.facts.get("signal"))
    elif record is not None:
        out.update(state="dead", cause=record.cause, died_at=record.written_at, record=record.path)
    elif diagnosis is not None:
        out.update(state=diagnosis.state, agent="blocked" if diagnosis.state != "no_answer" else "silent")
        if diagnosis.silent_for is not None:
            out["agent_silent_s"] = round(diagnosis.silent_for, 1)
            out["agent_last_ran"] = time.strftime("%H:%M:%S", time.localtime(time.time() - diagnosis.silent_for))
    if holder is not None:
        out["gil_holder"] = {"native_id": holder.native_id, "thread_name": holder.name, "where": holder.where()}
    if stacks is not None:
        out["python"] = stacks.python_version
        out["threads"] = len(stacks.program_threads())
    return out


def _dead_with_record(pid: int, answering: bool = False) -> Optional[ProcessDead]:
    """A dead process whose agent left a crash record: how it died, with the record attached."""
    from probe.reader import crash

    record = crash.dead_record(pid)
    if record is None:
        return None
    when = ", at %s" % time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.died_at)) if record.died_at else ""
    hint = ("its last stacks: `probe %d backtrace` (SQL over python.backtrace works too)" % pid if record.has_stacks
            else "it left no stacks; its exit status, or the kernel log (OOM killer), may say more")
    what = "died while answering" if answering else "is dead"
    exc = ProcessDead("process %d %s: %s%s" % (pid, what, record.cause, when), hint=hint)
    exc.record = record  # type: ignore[attr-defined]
    return exc


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


def _not_python(pid: int) -> str:
    """The name of process ``pid`` when it is certainly no Python interpreter, else "" (also when unsure)."""
    try:
        from probe.injector.target import read_target

        info = read_target(pid)
    except Exception:  # unreadable, gone, no injector: say nothing rather than something wrong
        return ""
    if info.is_python:
        return ""
    try:
        with open("/proc/%d/comm" % pid) as handle:
            return handle.read().strip() or os.path.basename(info.exe)
    except OSError:
        return os.path.basename(info.exe) or "?"


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


def _query_body(sql: str, max_rows: Optional[int], timeout: Optional[float],
                query_id: Optional[str] = None) -> Dict[str, Any]:
    body: Dict[str, Any] = {"sql": sql}
    if query_id is not None:
        body["id"] = query_id
    if max_rows is not None:
        body["max_rows"] = max_rows
    if timeout is not None:
        body["timeout"] = timeout
    return body




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
            timeout: Optional[float] = None, wait: Optional[float] = None,
            executable: Optional[str] = None) -> Client:
    """A client of the agent at ``target`` (a pid, ``host:port``, ``unix:PATH``; default ``$PROBE_TARGET``).

    For TCP, the token comes from ``token``, ``token_file``, ``$PROBE_TOKEN_FILE`` or ``$PROBE_TOKEN``.
    ``timeout``: seconds to wait for any answer; None: 30 s, or as long as a query's or snippet's limit
    needs. No request is sent until the first call.
    """
    target = target if target is not None else os.environ.get("PROBE_TARGET")
    if not target:
        raise UsageError("no target given", hint="give a pid, HOST:PORT or unix:PATH, or set PROBE_TARGET")
    parsed = parse_target(str(target))
    if parsed.snapshot is not None:  # a record, read here: no agent, no token
        from probe.snapshot.target import connect_record

        return connect_record(parsed.label)  # type: ignore[return-value]
    return Client(parsed, _read_token(token, token_file) if parsed.core is None else None, timeout, wait, executable)
