"""The client of one agent: every operation the CLI offers, as a method.

``query`` returns a ``pyarrow.Table``; ``query_rows`` returns plain rows without importing pyarrow (the
CLI uses it to stay fast). Where the agent cannot run SQL itself (its process cannot import DuckDB or
pyarrow), the client fetches the tables the query names and runs the query here, in the same
locked-down engine.
"""

import os
from typing import Any, Dict, List, Optional

import probe.client.transport as transport
from probe.client.connection import DEFAULT_TIMEOUT, Connection, read_token
from probe.client.explain import dead_with_record, process_state
from probe.client.fallback import frames_of, health_from_outside, note_for, outside_stacks
from probe.client.results import EvalResult, Frame, Rows, TableInfo
from probe.client.sources import kind_for
from probe.client.targets import parse_target
from probe.errors import ProbeError, SQLUnavailable, UsageError

__all__ = ["Client", "connect", "ARROW_STREAM", "DEFAULT_TIMEOUT", "query_body"]

ARROW_STREAM = "application/vnd.apache.arrow.stream"


class Client(Connection):
    """The client of one agent: a :class:`probe.client.sources.Source`, each call one request (see
    :class:`probe.client.connection.Connection`), falling back to what can be read from outside."""

    refuses = frozenset()  # type: ignore[var-annotated]  # a live agent makes every call (its scope may refuse)

    def __repr__(self) -> str:
        return "<probe.Client %s>" % self.target.label

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
            stacks = outside_stacks(exc)
            if stacks is None and self.target.core is None:
                raise
            if self.target.core is not None:
                stacks = self._read_core(False)
            return health_from_outside(self.target, exc, stacks)

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

    def backtrace(self, native: bool = False, fallback: bool = True) -> List[Frame]:
        """Every thread's stack, innermost frame first within each thread (the rows of python.backtrace).

        From the agent when it can answer; otherwise read from outside the process (GIL held, stopped),
        from its crash record (dead), or from a core file, and ``note`` says so. ``native`` adds the C
        frames, read from outside (a process on this host; it is stopped for tens of milliseconds).
        Without ``fallback``, the agent's answer or its error (``diagnose``: the error names the rank's
        state, and carries the stacks read from outside).
        """
        self.note = None
        if not fallback:
            return frames_of_answer(self._json("GET", "/v1/backtrace"))
        if self.target.core is not None or native:
            return frames_of(self._outside(native))
        try:
            self._quick = True
            try:
                raw = self._json("GET", "/v1/backtrace")
            finally:
                self._quick = False
        except ProbeError as exc:
            stacks = outside_stacks(exc, agentless=True)
            if stacks is None:
                raise
            self.note = note_for(exc, stacks)
            return frames_of(stacks)
        return frames_of_answer(raw)

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

        if process_state(pid) != "alive":
            dead = dead_with_record(pid)
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
        body = query_body(sql, max_rows, timeout, query_id)
        try:
            raw = self._json("POST", "/v1/query", body, timeout=self._answer_wait(timeout, 10.0))
            return Rows(tuple((c["name"], c["type"]) for c in raw["columns"]), raw["rows"],
                        bool(raw.get("truncated")), (raw.get("limits") or {}).get("max_rows"))
        except SQLUnavailable:
            pass  # asked again next time: the agent may run SQL itself later (its program imported DuckDB)
        except ProbeError as exc:
            stacks = outside_stacks(exc, agentless=True)
            if stacks is None:
                raise
            self.note = note_for(exc, stacks)
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
            stacks = outside_stacks(exc, agentless=True)
            if stacks is None:
                raise
            self.note = note_for(exc, stacks)
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

        response = self._call("POST", "/v1/query", query_body(sql, max_rows, timeout, query_id), accept=ARROW_STREAM,
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

    def profile(self, action: str, **options: Any) -> Dict[str, Any]:
        """A ``torch.profiler`` capture of N steps in the target: ``action`` is start (``steps``, ``shapes``,
        ``stacks``, ``memory``), status, fetch (the trace events, this rank as one process, and the epoch
        their ``ts`` counts from) or stop (cancel). ``probe.client.profile`` waits for it and merges ranks."""
        body: Dict[str, Any] = {"action": action}
        body.update({k: v for k, v in options.items() if v is not None})
        return self._json("POST", "/v1/torch/profile", body)



def frames_of_answer(raw: Dict[str, Any]) -> List[Frame]:
    """The frames of an agent's ``/v1/backtrace`` answer: each thread's chain indexes a shared frame list."""
    frames = raw["frames"]
    out = []
    for thread_id, name, native_id, is_main, chain in raw["threads"]:
        for depth, position in enumerate(chain):
            func, file, lineno, code = frames[position]
            out.append(Frame(thread_id, name, native_id, bool(is_main), depth, func, file, lineno, code))
    return out


def query_body(sql: str, max_rows: Optional[int], timeout: Optional[float],
                query_id: Optional[str] = None) -> Dict[str, Any]:
    body: Dict[str, Any] = {"sql": sql}
    if query_id is not None:
        body["id"] = query_id
    if max_rows is not None:
        body["max_rows"] = max_rows
    if timeout is not None:
        body["timeout"] = timeout
    return body





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
    kind = kind_for(parsed.label) if parsed.snapshot is not None else None
    if kind is not None:  # a kind registered from above (a record, read here: no agent, no token)
        return kind.one(parsed.label)  # type: ignore[no-any-return]
    return Client(parsed, read_token(token, token_file) if parsed.core is None else None, timeout, wait, executable)
