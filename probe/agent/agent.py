"""The agent: the listeners it serves on, its token, its lazily-built SQL engine, and its clean-up.

Runs in the target. It starts daemon threads only, imports neither DuckDB nor pyarrow until the first
query that needs them, never imports torch, removes its files at exit, and in a forked child lets go of
the parent's sockets.
"""

import atexit
import errno
import hmac
import importlib.util
import os
import secrets
import sys
import threading
import time
from typing import Any, List, Optional

from probe import _paths
from probe._fds import keep_stdio_open
from probe.agent.http import Request
from probe.agent.listener import Listener
from probe.agent.options import AgentOptions, binds_every_interface, parse_hostport
from probe.agent.token_file import token_from_file as _token_from_file  # the node helper's name for it too
from probe.agent.token_file import write_new
from probe.errors import ProbeError, SQLUnavailable, Unauthorized, UsageError
from probe._stderr import say as _say



def _quiet_s() -> float:
    try:
        value = float(os.environ.get("PROBE_SQL_QUIET") or 60.0)
    except ValueError:
        return 60.0
    return value if value > 0 else float("inf")


SQL_QUIET_S = _quiet_s()
"""Seconds without a query after which DuckDB's database is closed and its memory handed back
(``PROBE_SQL_QUIET``, default 60; 0: never)."""


def _sql_in_agent() -> Optional[bool]:
    """``PROBE_SQL_IN_AGENT``: 1 runs every query in the agent (DuckDB and pyarrow load into the target,
    some 100 MB), 0 never; unset (or anything else): only where the program imported both itself."""
    value = os.environ.get("PROBE_SQL_IN_AGENT", "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    return None


SQL_IN_AGENT = _sql_in_agent()

__all__ = ["Agent"]


class Agent:
    """One running agent. Create it through ``probe.agent.start``, which makes it a singleton."""

    def __init__(self, options: AgentOptions) -> None:
        self.options = options
        self.pid = os.getpid()
        self.started_at = time.time()
        self.unix_path: Optional[str] = None
        self.tcp_address: Optional[str] = None
        self.token_file: Optional[str] = None
        self.crash_record: Optional[str] = None
        """The file this process's last stacks go to should it crash (None: not armed)."""
        self.tcp_error: Optional[str] = None
        self.tcp_note: Optional[str] = None
        """Where TCP is not served on the port asked for (PROBE_PORT taken): whose it is, and where instead."""
        """Why the agent serves no TCP although asked to (bind failed, unusable token file); else None."""
        self._token: Optional[bytes] = None
        self.credentials = _unix_only(options.unix_scope, self.pid)
        """Who may do what (``probe.agent.scopes``): the tokens TCP takes, the unix socket owner's scope."""
        self._owned_files: List[str] = []
        self._listeners: List[Listener] = []
        self._engine: Any = None
        self._engine_lock = threading.Lock()
        self._engine_users = 0  # requests holding the engine now (see hold_engine)
        self._loaded_libraries: "tuple[str, ...]" = ()  # of duckdb and arrow, those the agent imported
        self._engine_last_used = 0.0  # time.monotonic() when the last of them let go

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> "Agent":
        from probe.agent.routes import Dispatcher
        from probe.tables import process_env

        process_env.show_secrets = self.options.show_secrets
        dispatcher = Dispatcher(self)
        keep_stdio_open()  # before anything is opened: a process started with 0-2 closed would get them
        _paths.ensure_runtime_dir()
        fallback = _paths.runtime_dir_fallback()
        if fallback is not None:
            _say("probe: the agent in process %d keeps its socket in %s: %s (PROBE_RUNTIME_DIR=DIR sets a "
                 "directory of your own; probe list and probe PID look there too)"
                 % (self.pid, fallback[0], fallback[1]))
        path = _paths.socket_path(self.pid)
        _refuse_if_served(path)
        unix = Listener.unix(path, dispatcher)
        self.unix_path = path
        self._owned_files.append(path)
        self._listeners.append(unix)
        try:
            if self.options.listen:
                self._start_tcp(dispatcher)
        except BaseException:
            self.stop()
            raise
        for listener in self._listeners:
            listener.start()
        atexit.register(self.stop)
        self.crash_record = _arm_crash_record()
        if self.crash_record:  # the accept thread looks after the record's descriptor too (see crash.check)
            import probe.agent.crash as crash

            unix.add_check(crash.check)
        _offer_step_boundary()
        _count_steps(unix)
        _keep_fr_copy(unix)
        unix.add_check(self.release_idle_engine)
        return self

    def _start_tcp(self, dispatcher: Any) -> None:
        """Listen on TCP as asked; when that cannot be, say why (stderr, ``tcp_error``) and serve unix only.

        A child started by multiprocessing's spawn or forkserver inherits ``PROBE_LISTEN`` and finds the
        port taken by its parent: it must still get its unix socket.
        """
        listen = str(self.options.listen)
        tcp = None
        try:
            host, port = parse_hostport(listen)
            try:
                tcp = Listener.tcp(host, port, dispatcher)
            except OSError as exc:
                if self.options.listen_fallback and port:  # a rank under PROBE_PORT: never left without TCP
                    tcp = self._any_free_port(host, port, dispatcher, exc)
                if tcp is None:
                    raise UsageError("cannot listen on %s: %s" % (listen, exc.strerror or exc),
                                     hint="give each process its own port, or PROBE_LISTEN=%s:0 for any free one"
                                     % ("[%s]" % host if ":" in host else host)) from None
            self._token = self._make_or_read_token().encode("utf-8")
            self.credentials = self._scoped_credentials()
        except (ProbeError, OSError, ValueError) as exc:
            if tcp is not None:
                tcp.close()
            self._token = None
            self.tcp_error = str(exc)
            _say("probe: the agent in process %d serves no TCP: %s; its unix socket %s serves"
                 % (self.pid, self.tcp_error, self.unix_path))
            return
        self.tcp_address = "%s:%d" % (host, tcp.port)
        self._listeners.append(tcp)
        if self.options.listen_note:
            _say("probe: the agent in process %d serves TCP on %s: %s" % (self.pid, self.tcp_address,
                                                                          self.options.listen_note))
        if binds_every_interface(host):
            _say("probe: the agent in process %d serves TCP on every interface (%s; token required); "
                 "PROBE_LISTEN=ADDRESS:PORT binds one" % (self.pid, self.tcp_address))

    def _any_free_port(self, host: str, port: int, dispatcher: Any, exc: OSError) -> Optional[Listener]:
        """Listen on a free port, the given one being taken; ``tcp_note`` says whose it is (``health``,
        ``probe list`` and ``ranks`` show it), since clients sent to it meet that process instead."""
        from probe.agent.port_holder import taken_note

        try:
            tcp = Listener.tcp(host, 0, dispatcher)
        except OSError:
            return None
        taken = taken_note(port) if getattr(exc, "errno", None) == errno.EADDRINUSE else "port %d: %s" % (
            port, exc.strerror or exc)
        self.tcp_note = "%s; serving on %s:%d instead" % (taken, "[%s]" % host if ":" in host else host, tcp.port)
        _say("probe: the agent in process %d: %s (clients given that port reach that process, which cannot prove "
             "it holds the job's token)" % (self.pid, self.tcp_note))
        return tcp

    def stop(self) -> None:
        """Close the listeners and remove our files; only the process that started us does this.

        A forked child inherits this method in its atexit hooks; there it does nothing (DuckDB's state
        and the files belong to the parent).
        """
        if os.getpid() != self.pid:
            return
        for listener in self._listeners:
            listener.close()
        self._listeners = []
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        for path in self._owned_files:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._owned_files = []
        _remove_progress()

    def forget_after_fork(self) -> None:
        """In a forked child: drop the parent's listening sockets; leave its files alone."""
        for listener in self._listeners:
            listener.forget()
        self._listeners = []
        self._owned_files = []
        if self._engine is not None:
            # The parent's DuckDB must never be destroyed in the child: its destructor tears down state
            # (threads, locks) that fork did not copy, and the child dies with SIGSEGV. DataLoader
            # workers are such children. Keep one reference forever; the child never uses it.
            _keep_alive_forever(self._engine)

    # -- security ---------------------------------------------------------------------------------

    def _make_or_read_token(self) -> str:
        """The TCP token: given, or read from an explicit token file we can trust, or made fresh.

        Without ``token`` or ``token_file`` the agent always makes a new token and writes it to
        ``<pid>.token``, replacing whatever is there: a file it did not write itself, in this life (one
        left by an earlier process with our pid, or planted), is never read.
        """
        if self.options.token:
            return self.options.token
        if self.options.token_file:
            token = _token_from_file(self.options.token_file)
            self.token_file = self.options.token_file
            return token
        path = _paths.token_path(self.pid)
        token = secrets.token_urlsafe(32)
        try:
            os.unlink(path)  # the runtime directory is ours alone; what is there is a leftover
        except FileNotFoundError:
            pass
        write_new(path, token)
        self.token_file = path
        self._owned_files.append(path)
        return token

    def _scoped_credentials(self) -> Any:
        """The full token (eval) and the control and read tokens where the target gave them: each from its
        variable or file (a file may be readable by others, never writable: it is meant to be handed out)."""
        from probe.agent.scopes import CONTROL, EVAL, READ, Credentials

        tokens = [(self._token or b"", EVAL, "full token")]
        files = {EVAL: self.token_file or ""}
        for scope, token, path, by in ((CONTROL, self.options.control_token, self.options.control_token_file,
                                        "control token"),
                                       (READ, self.options.read_token, self.options.read_token_file, "read token")):
            if not token and path:
                try:
                    token = _token_from_file(path, shared=True)
                    files[scope] = path
                except ProbeError as exc:
                    _say("probe: the agent in process %d takes no %s: %s" % (self.pid, by, exc))
                    continue
            if not token:
                continue
            if any(hmac.compare_digest(token.encode("utf-8"), known) for known, _, _ in tokens):
                _say("probe: the agent in process %d takes no %s: it is the same as a stronger token" % (self.pid, by))
                continue
            tokens.append((token.encode("utf-8"), scope, by))
        return Credentials(tokens, self.credentials.unix_scope, files)

    def authorize(self, request: Request) -> Any:
        """The request's grant (``probe.agent.scopes.Grant``): the unix socket's peer was checked at accept
        and has the unix scope; TCP needs the proof of one of our tokens (``probe.agent.handshake``)."""
        if request.transport != "unix" and self._token is None:
            from probe.agent.scopes import TOKEN_HINT

            raise Unauthorized("this agent requires a token on TCP", hint=TOKEN_HINT)
        return self.credentials.grant(request)

    # -- SQL --------------------------------------------------------------------------------------

    def sql_available(self) -> bool:
        """Whether this process can run SQL itself (DuckDB and pyarrow importable); no import happens."""
        try:
            return all(importlib.util.find_spec(m) is not None for m in ("duckdb", "pyarrow"))
        except (ImportError, ValueError):
            return False

    def sql_here(self) -> bool:
        """Whether a query the agent cannot answer in Python (``probe.engine.simple``) runs here, in DuckDB:
        when ``PROBE_SQL_IN_AGENT=1``, when the engine is built already, or, unless ``PROBE_SQL_IN_AGENT=0``,
        when the program itself imported DuckDB and pyarrow (they cost nothing more then). Otherwise the
        client runs it over the rows of the tables it names, and the target never loads them."""
        if self._engine is not None or SQL_IN_AGENT:
            return True
        return SQL_IN_AGENT is None and "duckdb" in sys.modules and "pyarrow" in sys.modules

    def engine(self) -> Any:
        """The engine, built on the first query (this is where DuckDB and pyarrow get imported). A request
        that runs a query holds it with :meth:`hold_engine` instead, so that it is not released meanwhile."""
        if self._engine is not None:
            return self._engine
        with self._engine_lock:
            return self._build_engine()

    def hold_engine(self) -> Any:
        """The engine (built if need be), held until :meth:`let_go_engine`: it is not released meanwhile."""
        with self._engine_lock:
            engine = self._build_engine()
            self._engine_users += 1
            return engine

    def let_go_engine(self) -> None:
        with self._engine_lock:
            self._engine_users -= 1
            self._engine_last_used = time.monotonic()

    def release_idle_engine(self) -> None:
        """Close DuckDB's database once no query has used it for ``SQL_QUIET_S`` (called on the accept
        thread at every wake) and hand the memory it freed back to the system, and the resident pages of
        the libraries the agent loaded (``page_out_libraries``); the next query that needs DuckDB opens a
        fresh one (some 20-40 ms). The modules stay loaded: Python cannot unload them."""
        if self._engine is None or self._engine_users or time.monotonic() - self._engine_last_used < SQL_QUIET_S:
            return  # the usual case, decided without the lock
        with self._engine_lock:
            if self._engine is None or self._engine_users or time.monotonic() - self._engine_last_used < SQL_QUIET_S:
                return
            engine, self._engine = self._engine, None
        try:
            engine.close()  # no query holds it: nothing to interrupt or wait for
            del engine
            from probe.engine.memory import page_out_libraries, return_memory

            return_memory()
            # The pages of the libraries the agent loaded (not those the program loaded itself): read back
            # from their files by the next query that needs them.
            page_out_libraries(self._loaded_libraries)
        except Exception:
            pass

    def _build_engine(self) -> Any:
        """The engine, built if there is none; called with ``_engine_lock`` held."""
        if self._engine is None:
            if not self.sql_available():
                raise SQLUnavailable("this process cannot import DuckDB and pyarrow, so it cannot run SQL "
                                     "itself", hint="the probe client runs such queries on its side")
            if not self.sql_here():
                raise SQLUnavailable("this query needs DuckDB, which the agent does not load into this process "
                                     "(with pyarrow, some 100 MB) unless PROBE_SQL_IN_AGENT=1 is set where it "
                                     "starts", hint="the probe client runs such queries on its side, over the rows "
                                                    "of the tables they name")
            # DuckDB itself loads into the engine's worker process only; pyarrow here carries the tables.
            self._loaded_libraries = ("arrow",) if "pyarrow" not in sys.modules else self._loaded_libraries
            from probe.agent.limits import Ceilings
            from probe.engine.isolated import IsolatedEngine

            # The engine's own bounds are the ceilings; each request passes the limits it runs under. DuckDB
            # runs in a worker process under a memory ceiling: in here no bound holds against one call that
            # builds a gigabyte (probe.engine.isolated).
            ceilings = Ceilings.from_env()
            self._engine = IsolatedEngine(_produce_arrow, max_rows=max(self.options.max_rows, ceilings.max_rows),
                                          timeout=max(self.options.query_timeout, ceilings.query_timeout),
                                          memory_limit=self.options.memory_limit,
                                          max_result_bytes=self.options.max_result_bytes)
            self._engine_last_used = time.monotonic()
        return self._engine


def _offer_step_boundary() -> None:
    """Let the torch tables read at a step boundary through the eval placement (no torch imported).
    The placement is imported on first use, not at agent start."""
    try:
        from probe.tables.torch import _common

        _common.between_steps = _run_between_steps
    except Exception:
        pass


def _count_steps(listener: Any) -> None:
    """Count optimizer steps (torch.steps) from the moment the program has torch.optim: the accept thread
    looks for it at each wake and puts the step hook in."""
    try:
        from probe.tables.torch import steps

        listener.add_check(steps.watch)
    except Exception:
        pass


def _keep_fr_copy(listener: Any) -> None:
    """Keep a copy of the Flight Recorder for when this process cannot run (probe.tables.torch.fr_copy):
    the accept thread looks at each wake, once the program has initialised torch.distributed."""
    try:
        from probe.tables.torch import fr_copy

        listener.add_check(fr_copy.look)
    except Exception:
        pass


def _remove_progress() -> None:
    """The step counter's progress file (made on the first optimizer step) and the Flight Recorder's copy
    go with the socket."""
    for name, remove in (("probe.tables.torch.steps", "remove_progress"), ("probe.tables.torch.fr_copy", "remove")):
        module = sys.modules.get(name)
        try:
            if module is not None:
                getattr(module, remove)()
        except Exception:
            pass


def _run_between_steps(work: Any, timeout: float) -> Any:
    from probe.agent.placement import run_between_steps

    return run_between_steps(work, timeout)


def _arm_crash_record() -> Optional[str]:
    """Leave last stacks behind should this process die of a signal or an uncaught exception (see
    ``probe.agent.crash``); ``PROBE_CRASH_RECORD=0`` switches it off. Never fails the agent's start."""
    if os.environ.get("PROBE_CRASH_RECORD", "1").strip() in ("0", "false", "no", "off"):
        return None
    try:
        import probe.agent.crash as crash

        return crash.install()
    except Exception:
        return None


def _refuse_if_served(path: str) -> None:
    """A socket at our path that accepts connections belongs to a live agent (another PID namespace that
    shares the runtime directory, where that pid is someone else): never take it over."""
    if _paths.socket_state(path) in ("listening", "unknown"):
        raise UsageError("an agent already serves on %s (a process with pid %d in another PID namespace that "
                         "shares this directory?); not taking its socket" % (path, os.getpid()),
                         hint="give this process its own PROBE_RUNTIME_DIR")


def _unix_only(unix_scope: str, pid: int) -> Any:
    """Credentials before TCP is set up: the unix socket owner's scope (``PROBE_UNIX_SCOPE``); a value
    that is no scope gives read, the least, and says so."""
    from probe.agent.scopes import READ, Credentials, parse_scope

    try:
        return Credentials([], parse_scope(unix_scope, "PROBE_UNIX_SCOPE"))
    except ValueError as exc:
        _say("probe: the agent in process %d: %s; its unix socket gives read only" % (pid, exc))
        return Credentials([], READ)


def _keep_alive_forever(obj: Any) -> None:
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _produce_arrow(name: str) -> Any:
    from probe.tables import get_table
    from probe.tables.registry import produce_arrow

    spec = get_table(name)
    if spec is None:
        return None
    return produce_arrow(spec)  # a table that gives Arrow itself (python.torch_trace) passes through
