"""DuckDB, locked down before any user SQL runs, over tables produced only when a query names them.

- one in-memory connection, created on first use and reused (opening one costs ~20 ms); a cursor per
  request, because one connection refuses concurrent calls;
- no file system, no extensions, no replacement scans, configuration locked, few threads, a memory
  limit; only a single SELECT (or EXPLAIN) statement is accepted;
- every table is a view ``ns.table`` over a per-cursor registration of that query's Arrow data;
- a time limit enforced with ``interrupt()`` (repeated until the query ends: DuckDB forgets one that
  arrives before execution starts), and a row cap reported as ``truncated``;
- a bound in bytes on each result, checked batch by batch as DuckDB hands it over, so a result past it
  is refused before it is materialised whole; no spilling to disk (``temp_directory`` is empty);
- a bound on the memory a query takes from the process, values included (DuckDB's ``memory_limit``
  leaves them out): every SELECT's rows pass through a materialised CTE that the buffer manager owns,
  and the process's RSS is watched while queries run (see ``probe.engine.memory``);
- at most ``MAX_SELECTS`` SELECTs in one query: DuckDB cannot interrupt binding and planning, whose
  time grows faster than the number of terms (a 20,000-term UNION ALL bound for minutes);
- ``close()`` interrupts every query in flight and waits for it to leave DuckDB: a thread still inside
  DuckDB when the interpreter finalises is ended by CPython in a way that aborts the process;
- what the parser says of an accepted query (one SELECT, the tables it names) is remembered by its text
  (``_CHECKED`` texts of at most ``_CHECKED_CHARS``): a query fanned out to every rank, or asked again
  by a watch, is parsed once per agent, not twice per request. Only the parser's verdict is kept:
  every run still binds, is time-limited and bounded in rows and bytes.
"""

import re
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set

from probe.engine.builders import check_builders
from probe.engine.memory import MemoryGuard, parse_size, return_memory, rss_bytes
from probe.engine.result import QueryResult
from probe.engine.watchdog import Watchdog
from probe.errors import Busy, SQLError, Timeout, TooLarge

__all__ = ["Engine", "TableSource", "referenced_tables", "MAX_SELECTS", "MAX_SQL_CHARS"]

MAX_SELECTS = 256
MAX_SQL_CHARS = 256 * 1024
_BATCH_ROWS = 2048  # DuckDB's vector size: the byte bound is checked at least this often
_INTERRUPT_EVERY = 0.02
_REMEMBERED = 256  # query ids remembered as finished or cancelled-before-start
_CLOSE_WAIT = 3.0
_SELECT = re.compile(r"\bSELECT\b", re.IGNORECASE)
_CHECKED = 128  # accepted query texts whose parse is remembered (see Engine._parsed)
_CHECKED_CHARS = 4096  # longer texts are parsed every time: the cache stays under ~0.5 MB

_RESULT = "__probe_result"  # the CTE every SELECT's rows pass through (see _wrapped)
_SUFFIXED = re.compile(r"_\d+$")  # how DuckDB renames a repeated column name in a subquery
_TRIM_AFTER = 64 << 20  # RSS growth during a query after which freed memory is handed back to the system

#: Called with the bytes a result has reached; raises (``Busy``) to stop it.
Reserve = Callable[[int], None]

#: name -> Arrow table, or None when no such table exists.
TableSource = Callable[[str], Optional[Any]]

_ALLOWED = {"SELECT", "EXPLAIN"}
_EXPLAIN_PREFIX = re.compile(r"^\s*EXPLAIN\s+(ANALY[SZ]E\s+)?", re.IGNORECASE)
_REFUSED = {
    "COPY": "COPY is not allowed: the engine has no file system access and is read-only",
    "EXPORT": "EXPORT is not allowed: the engine has no file system access",
    "SET": "SET is not allowed: the engine's configuration is locked",
    "VARIABLE_SET": "SET is not allowed: the engine's configuration is locked",
    "ATTACH": "ATTACH is not allowed: the engine has no file system access",
    "DETACH": "DETACH is not allowed: the engine has no file system access",
    "LOAD": "INSTALL and LOAD are not allowed: extensions are disabled",
    "EXTENSION": "INSTALL and LOAD are not allowed: extensions are disabled",
    "PRAGMA": "PRAGMA is not allowed: the engine's configuration is locked",
}


def _hidden_name(table: str) -> str:
    return "__probe_" + table.replace(".", "__")


_QUALIFIED = re.compile(r'"?([A-Za-z_][A-Za-z0-9_]*)"?\s*\.\s*"?([A-Za-z_][A-Za-z0-9_]*)"?')


def referenced_tables(sql: str, connection: Any) -> Set[str]:
    """Qualified names of the tables that ``sql`` may read, aliases stripped, lower-cased.

    DuckDB's parser answers this; where it cannot without binding (it binds ``JOIN ... USING`` and
    then fails, the tables being unknown to it), every ``ns.name`` in the text is a candidate:
    producing a table the query did not need costs time, never correctness. ``connection`` must have
    an empty catalog (with our views it would answer with the tables behind them); it is the engine's
    own, not the module-level ``duckdb.get_table_names``, which opens DuckDB's default database: that
    one nobody could keep from being torn down in a forked child, where teardown crashes.
    """
    import duckdb

    try:
        names = connection.get_table_names(sql, qualified=True)
    except duckdb.ParserException as exc:
        raise SQLError(_clean(exc)) from None
    except duckdb.Error:
        return {"%s.%s" % (a.lower(), b.lower()) for a, b in _QUALIFIED.findall(sql)}
    out = set()
    for name in names:
        bare = name.split(" AS ")[0].replace('"', "").strip().lower()
        out.add(bare)
    return out


class Engine:
    """One locked-down DuckDB database. Thread-safe: each :meth:`query` uses its own cursor."""

    def __init__(self, source: TableSource, max_rows: int = 100_000, timeout: float = 10.0,
                 memory_limit: str = "512MB", threads: int = 1, max_result_bytes: int = 64 << 20,
                 memory_budget: Optional[int] = None) -> None:
        """``memory_budget``: bytes the process's RSS may grow while queries run before they are all
        interrupted (default: twice ``memory_limit``, which DuckDB applies to its buffer manager only)."""
        import duckdb

        self._duckdb = duckdb
        self._source = source
        self.max_rows = max_rows
        self.timeout = timeout
        self.max_result_bytes = max_result_bytes
        self._active: Set[Any] = set()  # cursors of queries in flight
        self._by_id: Dict[str, Callable[[], None]] = {}  # query_id -> its interrupt, while it runs
        self._finished: Dict[str, None] = {}  # the last _REMEMBERED ids that ended, oldest first
        self._cancelled: Dict[str, None] = {}  # ids interrupted before they started (bounded likewise)
        self._active_cond = threading.Condition()
        self._closing = False
        self._views: Set[str] = set()
        self._view_schemas: Dict[str, Any] = {}  # name -> the Arrow schema its view was made with
        self._rebinds: Optional[bool] = None  # see _views_rebind
        self._checked: "OrderedDict[str, _Parsed]" = OrderedDict()  # sql -> what the parser said of it
        self._checked_lock = threading.Lock()  # held for dict operations only (str keys: no foreign code)
        self._watchdog = Watchdog()
        self._memory_limit_text = memory_limit
        limit_bytes = parse_size(memory_limit) or (512 << 20)
        self.memory_budget = int(memory_budget) if memory_budget else 2 * limit_bytes
        self._guard = MemoryGuard(self.memory_budget, self._watchdog.schedule, self._watchdog.cancel)
        self._lock = threading.Lock()
        self._con = _connect(duckdb, {
            "enable_external_access": False,
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
            "allow_community_extensions": False,
            "python_enable_replacements": False,
            "threads": threads,
            "memory_limit": memory_limit,
            "temp_directory": "",  # never spill into the target's working directory
        })
        self._con.execute("SET lock_configuration = true")
        self._con.fetchall()
        self._reader = _reader_for(self._con)
        # An empty database, only for finding the tables a query names (see referenced_tables).
        self._parser = _connect(duckdb, {"enable_external_access": False, "threads": 1})

    def query(self, sql: str, max_rows: Optional[int] = None, timeout: Optional[float] = None,
              max_bytes: Optional[int] = None, reserve: Optional[Reserve] = None,
              query_id: Optional[str] = None) -> QueryResult:
        """Run one SELECT. ``max_rows``, ``timeout`` and ``max_bytes`` may only lower the engine's limits.
        ``query_id`` names it for :meth:`interrupt` (a client's Ctrl-C)."""
        started = time.perf_counter()
        cap = self.max_rows if max_rows is None else max(0, min(int(max_rows), self.max_rows))
        limit = self.timeout if timeout is None else min(float(timeout), self.timeout)
        byte_cap = self.max_result_bytes if max_bytes is None else min(int(max_bytes), self.max_result_bytes)
        parsed = self._remembered(sql)
        if parsed is None:
            _check_size(sql)
        cursor = self._enter()
        fired: List[str] = []  # why it was stopped: "time", "memory"

        def interrupt() -> None:
            cursor.interrupt()

        def on_time() -> None:
            fired.append("time")
            cursor.interrupt()

        alarms = [self._watchdog.schedule(limit, on_time, repeat=_INTERRUPT_EVERY)]

        def stop_now() -> None:
            """A client's interrupt: repeated like the time limit's, since DuckDB forgets one that lands
            between the query's binding and its execution. Called with ``_active_cond`` held, so never
            after the ``finally`` below has let go of this query."""
            fired.append("time")
            alarms.append(self._watchdog.schedule(0.0, interrupt, repeat=_INTERRUPT_EVERY))

        def out_of_memory() -> None:
            """The memory guard's verdict (on the watchdog's thread): stop now and at every chunk after."""
            if "memory" not in fired:
                fired.append("memory")
            cursor.interrupt()

        if query_id is not None:
            with self._active_cond:
                self._by_id[query_id] = stop_now
                if query_id in self._cancelled:
                    del self._cancelled[query_id]
                    stop_now()  # its interrupt came first (the client's Ctrl-C while the query was on its way)
        watched = self._guard.enter(out_of_memory)
        start_rss = rss_bytes()
        wrapped = False  # past parsing, DuckDB's messages quote the wrapped query (_wrapped), not the user's
        try:
            if parsed is None:
                parsed = self._parse(cursor, sql)
            wrapped = True
            tables = self._produce(parsed.names)
            for name, data in tables.items():
                cursor.register(_hidden_name(name), data)
            del tables
            if fired:
                raise self._duckdb.InterruptException("deadline passed before the query started")
            table, truncated = self._run(cursor, parsed, cap, byte_cap, reserve)
        except (self._duckdb.InterruptException, Exception) as exc:
            if "memory" in fired or isinstance(exc, getattr(self._duckdb, "OutOfMemoryException", ())):
                raise self._too_much_memory() from None
            if fired or isinstance(exc, self._duckdb.InterruptException):
                raise Timeout("query interrupted after %.1f s (the agent's query time limit)" % limit,
                              hint="narrow the query, or raise the limit with PROBE_QUERY_TIMEOUT") from None
            if isinstance(exc, self._duckdb.Error):
                raise SQLError(_clean(exc, wrapped)) from None
            raise
        finally:
            self._guard.leave(watched)
            if query_id is not None:
                with self._active_cond:
                    self._by_id.pop(query_id, None)
                    self._finished[query_id] = None
                    while len(self._finished) > _REMEMBERED:
                        self._finished.pop(next(iter(self._finished)))
            for alarm in alarms:
                self._watchdog.cancel(alarm)
            self._leave(cursor)
            _give_back(start_rss)
        return QueryResult(table, truncated, (time.perf_counter() - started) * 1000.0)

    def _too_much_memory(self) -> TooLarge:
        return TooLarge("the query needed more memory than the agent lets SQL take from this process "
                        "(DuckDB's limit %s; the process may grow at most %s while queries run); it was stopped"
                        % (self._memory_limit_text, _megabytes(self.memory_budget)),
                        hint="select fewer or smaller values (LIMIT, WHERE, an aggregate, left(s, n)); the "
                             "target's owner sets the limit with PROBE_MEMORY_LIMIT")

    def interrupt(self, query_id: str) -> str:
        """Stop the query named ``query_id``: ``interrupted`` (it was running), ``finished`` (it had
        ended), or ``cancelled``: not seen yet, so it stops as soon as it starts (the interrupt of a
        client's Ctrl-C can overtake its query). It ends with the engine's time-out error."""
        with self._active_cond:
            stop = self._by_id.get(query_id)
            if stop is None:
                if query_id in self._finished:
                    return "finished"
                self._cancelled[query_id] = None
                while len(self._cancelled) > _REMEMBERED:
                    self._cancelled.pop(next(iter(self._cancelled)))
                return "cancelled"
            stop()  # schedules the interrupts; held under the lock so the query cannot end meanwhile
        return "interrupted"

    def close(self) -> None:
        """Interrupt every query in flight, wait (bounded) until none is inside DuckDB, then release it.

        Called at agent stop, which runs at interpreter exit: a request thread still inside DuckDB
        when the interpreter finalises is ended by CPython from within DuckDB's C++, and the process
        aborts (exit status 134) instead of exiting as the program meant to.
        """
        deadline = time.monotonic() + _CLOSE_WAIT
        with self._active_cond:
            self._closing = True
            while self._active and time.monotonic() < deadline:
                for cursor in list(self._active):
                    try:
                        cursor.interrupt()
                    except Exception:
                        pass
                self._active_cond.wait(_INTERRUPT_EVERY)
            if self._active:
                return  # a query DuckDB cannot interrupt: leave the database to the interpreter
        for con in (self._con, self._parser):
            try:
                con.close()
            except Exception:
                pass

    def _enter(self) -> Any:
        with self._active_cond:
            if self._closing:
                raise Busy("the agent is stopping: its process is exiting")
            cursor = self._con.cursor()
            self._active.add(cursor)
            return cursor

    def _leave(self, cursor: Any) -> None:
        try:
            cursor.close()
        except Exception:
            pass
        with self._active_cond:
            self._active.discard(cursor)
            self._active_cond.notify_all()

    def _remembered(self, sql: str) -> "Optional[_Parsed]":
        """What the parser said of an accepted query of this very text, if it was parsed lately."""
        with self._checked_lock:
            parsed = self._checked.get(sql)
            if parsed is not None:
                self._checked.move_to_end(sql)
            return parsed

    def _parse(self, cursor: Any, sql: str) -> "_Parsed":
        """Refuse anything but one SELECT; the tables it names. Remembered for short texts it accepts."""
        kind = self._check_statement(cursor, sql)
        parser = self._parser.cursor()  # one connection refuses concurrent calls: a cursor each
        try:
            names = frozenset(referenced_tables(sql, parser))
            # EXPLAIN plans its statement, and planning folds constants: range(10**9) is built there too.
            check_builders(_serialized(parser, _EXPLAIN_PREFIX.sub("", sql, count=1) if kind == "EXPLAIN" else sql))
        finally:
            parser.close()
        parsed = _Parsed(names, _statement_text(sql) if kind == "SELECT" else None, sql)
        if len(sql) <= _CHECKED_CHARS:
            with self._checked_lock:
                self._checked[sql] = parsed
                while len(self._checked) > _CHECKED:
                    self._checked.popitem(last=False)
        return parsed

    def _check_statement(self, cursor: Any, sql: str) -> str:
        try:
            statements = cursor.extract_statements(sql)
        except self._duckdb.Error as exc:
            raise SQLError(_clean(exc)) from None
        if not statements:
            raise SQLError("empty query: give one SELECT statement")
        if len(statements) > 1:
            raise SQLError("one statement per query, got %d" % len(statements))
        kind = _kind(statements[0])
        if kind not in _ALLOWED:
            raise SQLError(_REFUSED.get(kind, "%s statements are not allowed: only SELECT queries run here" % kind))
        if kind == "EXPLAIN":
            # EXPLAIN ANALYZE runs the statement it explains: that one must be a SELECT too.
            inner = _EXPLAIN_PREFIX.sub("", sql, count=1)
            try:
                explained = cursor.extract_statements(inner)
            except self._duckdb.Error:
                explained = []
            if len(explained) != 1 or _kind(explained[0]) != "SELECT":
                raise SQLError("EXPLAIN is allowed only of a single SELECT statement")
        return kind

    def _produce(self, names: FrozenSet[str]) -> Dict[str, Any]:
        """Produce the tables the query names (and only those); create their views on first sight."""
        out: Dict[str, Any] = {}
        for name in sorted(names):
            if "." not in name:
                continue  # a CTE or an unqualified name: DuckDB resolves (or rejects) it itself
            data = self._source(name)
            if data is None:
                continue  # unknown: DuckDB's own "does not exist" error names it
            self._ensure_view(name, data)
            out[name] = data
        return out

    def adopt(self, tables: Dict[str, Any]) -> bool:
        """Whether this engine can run queries over ``tables`` (name -> Arrow table; a client that keeps one
        engine for the queries it runs over agents' rows asks this first): every table it has a view of
        must come with the schema the view was made with. Views of the others are made now."""
        with self._lock:
            for name, data in tables.items():
                known = self._view_schemas.get(name)
                if known is not None and not known.equals(data.schema) and not self._views_rebind():
                    return False
            for name, data in tables.items():
                if name not in self._views:
                    self._create_view(name, data)
        return True

    def _views_rebind(self) -> bool:
        """Whether this DuckDB binds a view again at each query, so that a view made over one schema
        reads data of another (2.0 does; 1.x says "Contents of view were altered"). Tried once, on a
        database of its own."""
        if self._rebinds is None:
            import pyarrow as pa

            con = _connect(self._duckdb, {"enable_external_access": False, "threads": 1})
            try:
                con.register("__probe_check", pa.table({"a": [1]}).slice(0, 0))
                con.execute("CREATE VIEW __probe_view AS SELECT * FROM __probe_check")
                cursor = con.cursor()
                cursor.register("__probe_check", pa.table({"b": ["x"], "c": [2.5]}))
                self._rebinds = cursor.execute("SELECT * FROM __probe_view").fetchall() == [("x", 2.5)]
                cursor.close()
            except Exception:
                self._rebinds = False
            finally:
                con.close()
        return self._rebinds

    def _ensure_view(self, name: str, data: Any) -> None:
        if name in self._views:
            return
        with self._lock:
            if name in self._views:
                return
            self._create_view(name, data)

    def _create_view(self, name: str, data: Any) -> None:
        """The view ``name`` over the per-cursor registration of its data; called with ``_lock`` held."""
        schema, table = name.split(".", 1)
        hidden = _hidden_name(name)
        # The view binds at creation, so an empty placeholder of the same schema stands in; each
        # query's cursor registers the real data under the same name.
        self._con.register(hidden, data.slice(0, 0))
        self._con.execute('CREATE SCHEMA IF NOT EXISTS "%s"' % schema)
        self._con.execute('CREATE OR REPLACE VIEW "%s"."%s" AS SELECT * FROM %s' % (schema, table, hidden))
        self._con.fetchall()
        self._view_schemas[name] = data.schema
        self._views.add(name)

    def _run(self, cursor: Any, parsed: "_Parsed", cap: int, byte_cap: int,
             reserve: Optional[Reserve]) -> "tuple[Any, bool]":
        """The result, read batch by batch so that neither the row cap nor the byte bound is passed."""
        import pyarrow as pa

        sql = parsed.sql if parsed.select is None else _wrapped(parsed.select, cap)
        reader = self._reader(cursor, sql, min(max(cap, 1) + 1, _BATCH_ROWS))
        try:
            schema = reader.schema
            batches: List[Any] = []
            count = size = 0
            truncated = False
            for batch in reader:
                if count + batch.num_rows > cap:
                    batch = batch.slice(0, cap - count)
                    truncated = True
                size += batch.nbytes
                if size > byte_cap:
                    raise TooLarge("the result is larger than %s, the agent's bound for one result"
                                   % _megabytes(byte_cap),
                                   hint="select fewer rows or columns (LIMIT, WHERE, an aggregate), or raise "
                                        "PROBE_MAX_RESULT_BYTES where the agent starts")
                if reserve is not None:
                    reserve(size)
                batches.append(batch)
                count += batch.num_rows
                if truncated:
                    break
            table = pa.Table.from_batches(batches, schema=schema)
        finally:
            reader = None  # freed here, on this thread, not by a later collection
        if parsed.select is not None and any(_SUFFIXED.search(name) for name in table.column_names):
            table = table.rename_columns(self._own_names(cursor, parsed.select, table.column_names))
        return table, truncated

    def _own_names(self, cursor: Any, select: str, names: List[str]) -> List[str]:
        """The query's own column names where the CTE renamed repeated ones (``a, a`` -> ``a, a_1``)."""
        try:
            own = list(cursor.sql(select).columns)
        except Exception:
            return names
        return own if len(own) == len(names) else names


class _Parsed:
    """What the parser said of an accepted query: the tables it names, and for a SELECT the text to wrap."""

    __slots__ = ("names", "select", "sql")

    def __init__(self, names: FrozenSet[str], select: Optional[str], sql: str = "") -> None:
        self.names = names
        self.select = select
        self.sql = sql


def _statement_text(sql: str) -> str:
    """``sql`` without its trailing semicolons and the comments after them (``SELECT 1; -- x``), so that
    it can stand inside parentheses."""
    import duckdb

    try:
        tokens = duckdb.tokenize(sql)
    except Exception:
        return sql
    end = len(sql)
    for position, kind in reversed(tokens):
        name = str(kind).rsplit(".", 1)[-1]
        if name == "comment":
            end = position
            continue
        if name == "operator" and sql[position:end].strip() == ";":
            end = position
            continue
        break
    return sql[:end].rstrip()


def _wrapped(select: str, cap: int) -> str:
    """The query whose rows pass through a collection that DuckDB's buffer manager owns (so its
    ``memory_limit`` covers them) before they are copied into the result and its Arrow buffers, which it
    does not cover; at most ``cap + 1`` of them (the row cap, and the one that says it was reached).
    The line break ends a comment the query may end with."""
    return "WITH %s AS MATERIALIZED (SELECT * FROM (%s\n) LIMIT %d) SELECT * FROM %s" % (
        _RESULT, select, max(cap, 0) + 1, _RESULT)


def _give_back(start_rss: Optional[int]) -> None:
    """After a query that grew the process a lot, hand the memory glibc keeps back to the system."""
    if start_rss is None:
        return
    now = rss_bytes()
    if now is not None and now - start_rss >= _TRIM_AFTER:
        return_memory()


def _connect(duckdb: Any, config: Dict[str, Any]) -> Any:
    """A new in-memory database without DuckDB's async I/O threads where it has them (2.0 starts 8 per
    database by default, 1.5 has none: 16 idle threads in the target for nothing, since the engine reads
    no file and no network)."""
    try:
        return duckdb.connect(":memory:", config=dict(config, async_threads=0))
    except duckdb.Error as exc:
        if "async_threads" not in str(exc):
            raise
    return duckdb.connect(":memory:", config=config)


def _public_reader(cursor: Any, sql: str, batch_rows: int) -> Any:
    return cursor.sql(sql).to_arrow_reader(batch_rows)


def _direct_reader(cursor: Any, sql: str, batch_rows: int) -> Any:
    return cursor._submit(sql, None, "stream", batch_rows).arrow_reader()


def _reader_for(con: Any) -> Callable[[Any, str, int], Any]:
    """How a query becomes a stream of Arrow batches on this DuckDB.

    DuckDB 2.0's public ``cursor.sql(q)`` binds the statement once to describe the relation, and its
    ``to_arrow_reader()`` then parses and binds it again to run it: 0.36 ms of the ~1.6 ms a small
    query costs the target. Its cursors' ``_submit`` runs one statement straight into a reader. Being
    private, it is used only where it exists and gives the right answer to a check here; elsewhere
    (DuckDB 1.x, or a later release that changed it) the public path.
    """
    cursor = con.cursor()
    try:
        table = _direct_reader(cursor, "SELECT 42 AS probe_check", 16).read_all()
        if table.column_names == ["probe_check"] and table.column(0).to_pylist() == [42]:
            return _direct_reader
    except Exception:
        pass
    finally:
        try:
            cursor.close()
        except Exception:
            pass
    return _public_reader


def _serialized(parser: Any, sql: str) -> str:
    """DuckDB's parse tree of ``sql`` as JSON text (empty where it cannot give one: nothing is checked)."""
    try:
        row = parser.execute("SELECT json_serialize_sql(?::VARCHAR)", [sql]).fetchone()
    except Exception:
        return ""
    return row[0] if row and isinstance(row[0], str) else ""


def _check_size(sql: str) -> None:
    if len(sql) > MAX_SQL_CHARS:
        raise SQLError("the query is %d characters long; the agent accepts at most %d" % (len(sql), MAX_SQL_CHARS))
    selects = len(_SELECT.findall(sql))
    if selects > MAX_SELECTS:
        raise SQLError("the query has %d SELECTs; the agent accepts at most %d (DuckDB cannot interrupt the "
                       "binding of a query, and its time grows faster than the number of terms)"
                       % (selects, MAX_SELECTS))


def _megabytes(size: int) -> str:
    return "%.0f MB" % (size / 1e6) if size >= 10 ** 6 else "%d bytes" % size


def _kind(statement: Any) -> str:
    """``StatementType.SELECT`` -> ``"SELECT"``."""
    return str(statement.type).rsplit(".", 1)[-1]


def _clean(exc: BaseException, wrapped: bool = False) -> str:
    """DuckDB's message, without the Python class name it sometimes carries. ``wrapped``: the error came
    from the query as probe wraps it, so the lines DuckDB quotes (``LINE 1: ...`` and a caret) show probe's
    text, not the user's: they are left out."""
    message = str(exc).strip()
    if wrapped and "\nLINE " in message:
        message = message.split("\nLINE ", 1)[0].strip()
    return message
