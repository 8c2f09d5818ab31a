"""The agent: the listeners it serves on, its token, its lazily-built SQL engine, and its clean-up.

Runs in the target. It starts daemon threads only, imports neither DuckDB nor pyarrow until the first
query that needs them, never imports torch, removes its files at exit, and in a forked child lets go of
the parent's sockets.
"""

import atexit
import hmac
import importlib.util
import os
import secrets
import threading
import time
from typing import Any, List, Optional

from probe import _paths
from probe.agent.http import Request
from probe.agent.listener import Listener
from probe.agent.options import AgentOptions, parse_hostport
from probe.errors import SQLUnavailable, Unauthorized

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
        self._token: Optional[bytes] = None
        self._owned_files: List[str] = []
        self._listeners: List[Listener] = []
        self._engine: Any = None
        self._engine_lock = threading.Lock()

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> "Agent":
        from probe.agent.routes import Dispatcher
        from probe.tables import process_env

        process_env.show_secrets = self.options.show_secrets
        dispatcher = Dispatcher(self)
        _paths.ensure_runtime_dir()
        path = _paths.socket_path(self.pid)
        unix = Listener.unix(path, dispatcher)
        self.unix_path = path
        self._owned_files.append(path)
        self._listeners.append(unix)
        try:
            if self.options.listen:
                self._token = self._load_or_make_token().encode("utf-8")
                host, port = parse_hostport(self.options.listen)
                tcp = Listener.tcp(host, port, dispatcher)
                self.tcp_address = "%s:%d" % (host, tcp.port)
                self._listeners.append(tcp)
        except BaseException:
            self.stop()
            raise
        for listener in self._listeners:
            listener.start()
        atexit.register(self.stop)
        return self

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

    def _load_or_make_token(self) -> str:
        if self.options.token:
            return self.options.token
        path = self.options.token_file or _paths.token_path(self.pid)
        if os.path.exists(path):
            with open(path) as handle:
                token = handle.read().strip()
            if token:
                self.token_file = path
                return token
        token = secrets.token_urlsafe(32)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
        self.token_file = path
        self._owned_files.append(path)
        return token

    def authorize(self, request: Request) -> None:
        """The unix socket's peer was checked at accept; TCP needs ``Authorization: Bearer <token>``."""
        if request.transport == "unix":
            return
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if self._token is None or scheme.lower() != "bearer" or not value:
            raise Unauthorized("this agent requires a token on TCP",
                               hint="pass --token-file FILE with the agent's token (on its host: %s)"
                               % (self.token_file or "the file given to the agent"))
        if not hmac.compare_digest(value.strip().encode("utf-8"), self._token):
            raise Unauthorized("the token was refused", hint="check --token / --token-file against the agent's token file")

    # -- SQL --------------------------------------------------------------------------------------

    def sql_available(self) -> bool:
        """Whether this process can run SQL itself (DuckDB and pyarrow importable); no import happens."""
        try:
            return all(importlib.util.find_spec(m) is not None for m in ("duckdb", "pyarrow"))
        except (ImportError, ValueError):
            return False

    def engine(self) -> Any:
        """The engine, built on the first query (this is where DuckDB and pyarrow get imported)."""
        if self._engine is not None:
            return self._engine
        with self._engine_lock:
            if self._engine is None:
                if not self.sql_available():
                    raise SQLUnavailable("this process cannot import DuckDB and pyarrow, so it cannot run SQL "
                                         "itself", hint="the probe client runs such queries on its side")
                from probe.engine import Engine

                self._engine = Engine(_produce_arrow, max_rows=self.options.max_rows,
                                      timeout=self.options.query_timeout, memory_limit=self.options.memory_limit)
        return self._engine


def _keep_alive_forever(obj: Any) -> None:
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _produce_arrow(name: str) -> Any:
    from probe.tables import get_table, produce_columns
    from probe.tables.arrow import from_columns

    spec = get_table(name)
    if spec is None:
        return None
    return from_columns([(c.name, c.type) for c in spec.columns], produce_columns(spec))
