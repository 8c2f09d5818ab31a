"""The locked-down engine run in a worker process of its own, whose memory the kernel bounds.

Wherever SQL runs (the agent, with ``PROBE_SQL_IN_AGENT=1`` or in a program that imported DuckDB; the
client, by default), DuckDB runs in a worker started here (``probe.engine.worker``) under ``RLIMIT_AS``:
its size once ready plus ``max_memory``. Inside one process no bound holds against a single function call
that builds a gigabyte (``replace``, ``regexp_replace``, any function DuckDB adds later); in the worker
the allocation past the ceiling fails where it is made, and the process that asked sees an error.
The caller keeps only pyarrow: the tables go to the worker and the result comes back as Arrow IPC.

- one worker per engine, started on the first query (or early, by :meth:`IsolatedEngine.start`), kept
  for the next ones, one query at a time (a second waits up to its time limit, then gets ``busy``);
- the worker asks for each table its query names, so only those are produced, on the caller's thread;
- every wait has a deadline: the worker's own engine interrupts a query at its time limit, and a worker
  still silent ``_GRACE`` s later (a single call DuckDB cannot interrupt) is killed;
- an interrupt (a client's Ctrl-C) kills the worker if its query is running: the next query starts a
  fresh one;
- in the target: no thread of its own, file descriptors non-blocking and close-on-exec, ``poll`` (not
  ``select``, which fails on descriptors past 1024), the worker in a session of its own, without the
  ``PROBE*`` variables (so it starts no agent), killed at :meth:`close`.
"""

import json
import os
import sys
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from probe.engine.memory import parse_size
from probe.engine.result import QueryResult
from probe.errors import Busy, SQLUnavailable, Timeout, TooLarge, error_from_code

__all__ = ["IsolatedEngine"]

_START_WAIT = 60.0  # seconds a worker may take to import DuckDB and pyarrow (1-3 s on a loaded 2-core box)
_GRACE = 5.0  # seconds past a query's time limit before its worker is killed
_REMEMBERED = 256  # query ids remembered as finished or cancelled before they started
_BOOT = ("import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
         "from probe.engine.worker import main; main(sys.argv[2])")

TableSource = Callable[[str], Optional[Any]]


class _Died(Exception):
    """The worker's channel ended: it died, or was killed."""


class _Process:
    """One worker process and its channel, as the caller's side sees it."""

    def __init__(self, config: Dict[str, Any]) -> None:
        import subprocess

        if not sys.executable:
            raise SQLUnavailable("this process has no Python executable to start the SQL worker with",
                                 hint="the probe client runs such queries on its side")
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        paths = [root] + [os.path.abspath(p) if p else os.getcwd() for p in sys.path if isinstance(p, str)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PROBE")}
        env["ARROW_DEFAULT_MEMORY_POOL"] = "system"  # jemalloc reserves address space the ceiling counts
        try:
            self.popen = subprocess.Popen([sys.executable, "-s", "-c", _BOOT, json.dumps(paths), json.dumps(config)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, close_fds=True, start_new_session=True,
                                          env=env)
        except OSError as exc:
            raise SQLUnavailable("could not start the SQL worker (%s)" % exc,
                                 hint="the probe client runs such queries on its side") from None
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.to, self.fro = self.popen.stdin.fileno(), self.popen.stdout.fileno()
        os.set_blocking(self.to, False)
        os.set_blocking(self.fro, False)
        self.pid = self.popen.pid
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        message = None
        try:
            message = self.receive(time.monotonic() + _START_WAIT, 1 << 16)
        except _Died:
            pass
        if message is None or not message[0].get("ready"):
            self.kill()
            why = (message[0].get("message") if message else None) or "it ended or stayed silent before it was ready"
            raise SQLUnavailable("the SQL worker could not start: %s" % why,
                                 hint="the probe client runs such queries on its side")
        self.ready = True

    def send(self, header: Dict[str, Any], payload: bytes, deadline: float) -> None:
        from probe.engine.worker import _HEADER

        head = json.dumps(dict(header, size=len(payload))).encode("utf-8")
        for part in (_HEADER.pack(len(head)) + head, payload):
            view = memoryview(part)
            while view:
                self._wait(self.to, _POLLOUT, deadline)
                try:
                    view = view[os.write(self.to, view):]
                except BlockingIOError:
                    continue
                except OSError:
                    raise _Died() from None

    def receive(self, deadline: float, max_payload: int) -> Optional[Tuple[Dict[str, Any], bytes]]:
        """The next message; None when the deadline passed first. Raises _Died when the worker has gone."""
        from probe.engine.worker import _HEADER, MAX_HEADER

        raw = self._read(_HEADER.size, deadline)
        if raw is None:
            return None
        (length,) = _HEADER.unpack(raw)
        if length > MAX_HEADER:
            raise _Died()
        head = self._read(length, deadline)
        if head is None:
            return None
        header = json.loads(head.decode("utf-8"))
        size = int(header.get("size") or 0)
        if size > max_payload:
            raise _Died()  # more than anything it may send: it is not answering as it should
        payload = self._read(size, deadline) if size else b""
        if payload is None:
            return None
        return header, payload

    def _read(self, size: int, deadline: float) -> Optional[bytes]:
        parts: List[bytes] = []
        got = 0
        while got < size:
            if not self._wait(self.fro, _POLLIN, deadline, quiet=True):
                return None
            try:
                chunk = os.read(self.fro, min(size - got, 1 << 20))
            except BlockingIOError:
                continue
            except OSError:
                raise _Died() from None
            if not chunk:
                raise _Died()
            parts.append(chunk)
            got += len(chunk)
        return b"".join(parts)

    def _wait(self, fd: int, events: int, deadline: float, quiet: bool = False) -> bool:
        import select

        poller = select.poll()
        poller.register(fd, events)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if quiet:
                    return False
                raise _Died()
            if poller.poll(min(left, 1.0) * 1000.0):
                return True

    def kill(self) -> None:
        try:
            self.popen.kill()
        except OSError:
            pass

    def reap(self) -> Optional[int]:
        """Its exit status once gone (waits at most a second); None if it is still there."""
        import subprocess

        for stream in (self.popen.stdin, self.popen.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass
        try:
            return self.popen.wait(1.0)
        except subprocess.TimeoutExpired:
            return None


_POLLIN, _POLLOUT = 0x001, 0x004


class IsolatedEngine:
    """The engine's interface (``query``, ``interrupt``, ``close``) over a worker process. Thread-safe."""

    def __init__(self, source: TableSource, max_rows: int = 100_000, timeout: float = 10.0,
                 memory_limit: str = "512MB", max_result_bytes: int = 64 << 20,
                 max_memory: Optional[int] = None) -> None:
        """``max_memory``: bytes the worker's address space may grow past its size once ready (default:
        twice ``memory_limit``, DuckDB's own limit for its buffer manager, which it keeps inside)."""
        self._source = source
        self.max_rows = max_rows
        self.timeout = timeout
        self.max_result_bytes = max_result_bytes
        self.memory_limit = memory_limit
        limit = parse_size(memory_limit) or (512 << 20)
        self.max_memory = int(max_memory) if max_memory else 2 * limit
        self._config = {"max_rows": max_rows, "timeout": timeout, "memory_limit": memory_limit,
                        "max_result_bytes": max_result_bytes, "max_memory": self.max_memory}
        self._turn = threading.Lock()  # the worker runs one query at a time
        self._state = threading.Lock()  # the fields below; never held while waiting on the worker
        self._worker: Optional[_Process] = None
        self._running: Optional[str] = None
        self._killed = False  # the running query's worker was killed by an interrupt
        self._finished: "OrderedDict[str, None]" = OrderedDict()
        self._cancelled: "OrderedDict[str, None]" = OrderedDict()
        self._closing = False
        self._pid = os.getpid()

    def start(self) -> None:
        """Start the worker now without waiting for it (a caller with other work to do first)."""
        with self._state:
            if self._worker is None and not self._closing:
                self._worker = _Process(self._config)

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
              max_bytes: Optional[int] = None, reserve: Optional[Callable[[int], None]] = None,
              query_id: Optional[str] = None, tables: Optional[Dict[str, Any]] = None) -> QueryResult:
        """Run one SELECT in the worker, as ``Engine.query`` does. ``tables``: name -> Arrow table, given
        with the query (the others named are asked of ``source``)."""
        from probe.engine.sandbox import _check_size

        started = time.perf_counter()
        cap = self.max_rows if max_rows is None else max(0, min(int(max_rows), self.max_rows))
        limit = self.timeout if timeout is None else min(float(timeout), self.timeout)
        byte_cap = self.max_result_bytes if max_bytes is None else min(int(max_bytes), self.max_result_bytes)
        _check_size(sql)
        if not self._turn.acquire(timeout=limit):
            raise Busy("another query held the SQL worker for all of this one's %g s" % limit,
                       hint="try again, or narrow the query that runs")
        try:
            with self._state:
                if self._closing:
                    raise Busy("the SQL engine is closing: its process is exiting")
                if query_id is not None and query_id in self._cancelled:
                    del self._cancelled[query_id]
                    raise _interrupted(limit)
                self._running, self._killed = query_id, False
                if self._worker is None:
                    self._worker = _Process(self._config)
                worker = self._worker
            table, truncated, elapsed = self._exchange(worker, sql, cap, limit, byte_cap, reserve, tables)
        finally:
            with self._state:
                self._running = None
                if query_id is not None:
                    self._finished[query_id] = None
                    while len(self._finished) > _REMEMBERED:
                        self._finished.popitem(last=False)
            self._turn.release()
        return QueryResult(table, truncated, max(elapsed, (time.perf_counter() - started) * 1000.0))

    def _exchange(self, worker: _Process, sql: str, cap: int, limit: float, byte_cap: int,
                  reserve: Optional[Callable[[int], None]], tables: Optional[Dict[str, Any]]) -> Tuple[Any, bool, float]:
        from probe.engine.worker import from_ipc, ipc_bytes

        failed: List[BaseException] = []  # what the source raised: the query's error, once the worker answered
        try:
            try:
                worker.wait_ready()
            except SQLUnavailable:
                self._lose(worker)
                with self._state:
                    if self._killed:  # an interrupt came while it started
                        raise _interrupted(limit) from None
                raise
            header: Dict[str, Any] = {"op": "query", "sql": sql, "max_rows": cap, "timeout": limit, "max_bytes": byte_cap}
            given = [(name, ipc_bytes(data)) for name, data in (tables or {}).items()]
            header["tables"] = [[name, len(blob)] for name, blob in given]
            payload = b"".join(blob for _, blob in given)
            del given
            deadline = time.monotonic() + limit + _GRACE
            worker.send(header, payload, deadline)
            del payload
            while True:
                message = worker.receive(deadline, 2 * byte_cap + (1 << 20))
                if message is None:
                    self._lose(worker)
                    raise _interrupted(limit)
                answer, body = message
                if "need" in answer:
                    self._give(worker, str(answer["need"]), deadline, failed)
                    continue
                if failed:
                    raise failed[0]
                if not answer.get("ok"):
                    raise error_from_code(str(answer.get("code")), str(answer.get("message")), answer.get("hint"))
                if reserve is not None:
                    reserve(len(body))
                return from_ipc(body), bool(answer.get("truncated")), float(answer.get("elapsed_ms") or 0.0)
        except _Died:
            status = self._lose(worker)
            with self._state:
                killed, closing = self._killed, self._closing
            if closing:
                raise Busy("the SQL engine is closing: its process is exiting") from None
            if killed:
                raise _interrupted(limit) from None
            raise TooLarge("the query needed more memory than SQL may take, or its SQL worker failed: the worker "
                           "ended (%s); a value past the %.0f MB it may take ends it so"
                           % (_status(status), self.max_memory / 1e6),
                           hint="select fewer or smaller values (LIMIT, WHERE, an aggregate, left(s, n))") from None

    def _give(self, worker: _Process, name: str, deadline: float, failed: List[BaseException]) -> None:
        """A table the worker's query names, produced here (or said missing)."""
        from probe.engine.worker import ipc_bytes

        data = None
        if not failed:
            try:
                data = self._source(name)
            except Exception as exc:
                failed.append(exc)
        if data is None:
            worker.send({"table": name, "missing": True}, b"", deadline)
        else:
            worker.send({"table": name}, ipc_bytes(data), deadline)

    def _lose(self, worker: _Process) -> Optional[int]:
        """Kill and reap a worker that cannot go on; the next query starts another."""
        with self._state:
            if self._worker is worker:
                self._worker = None
        worker.kill()
        return worker.reap()

    def interrupt(self, query_id: str) -> str:
        """``interrupted`` (it ran: its worker is killed), ``finished``, or ``cancelled`` (not started yet:
        it stops as it starts), as ``Engine.interrupt``."""
        with self._state:
            if self._running == query_id and query_id is not None:
                self._killed = True
                if self._worker is not None:
                    self._worker.kill()
                return "interrupted"
            if query_id in self._finished:
                return "finished"
            self._cancelled[query_id] = None
            while len(self._cancelled) > _REMEMBERED:
                self._cancelled.popitem(last=False)
            return "cancelled"

    def worker_pid(self) -> Optional[int]:
        """The worker's pid while one runs (for tests and benches)."""
        worker = self._worker
        return worker.pid if worker is not None else None

    def close(self) -> None:
        """Kill the worker (a query in flight ends with ``busy``). In a forked child, whose worker is the
        parent's, nothing is done."""
        with self._state:
            self._closing = True
            worker, self._worker = self._worker, None
        if worker is not None and os.getpid() == self._pid:
            worker.kill()
            worker.reap()


def _interrupted(limit: float) -> Timeout:
    return Timeout("query interrupted after %.1f s (the query time limit), or by an interrupt" % limit,
                   hint="narrow the query, or raise the limit with PROBE_QUERY_TIMEOUT")


def _status(status: Optional[int]) -> str:
    if status is None:
        return "still ending"
    if status < 0:
        import signal

        try:
            return "killed by %s" % signal.Signals(-status).name
        except ValueError:
            return "killed by signal %d" % -status
    return "exit status %d" % status
