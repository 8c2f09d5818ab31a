"""``process.info``: one row about this process (psutil, imported on the first query)."""

import datetime
import os
import socket
import sys
import threading
from typing import Any, Iterator, List, Optional, Tuple

import probe.tables.process_env as process_env
from probe.tables.redact import mask_argv
from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "process.info"
DESCRIPTION = "One row describing this process: identity, command, resources and interpreter."
COLUMNS = (
    Column("pid", "BIGINT", "Process id."),
    Column("ppid", "BIGINT", "Parent process id."),
    Column("hostname", "VARCHAR", "Host name."),
    Column("cmdline", "VARCHAR", "Command line, arguments joined by spaces; unless the agent shows secrets, the values "
                                 "of secret-looking flags (--password X, --api-key=X; not --token-file /path), "
                                 "secret name=value arguments and URL passwords are '********'."),
    Column("cwd", "VARCHAR", "Current working directory."),
    Column("user", "VARCHAR", "Name of the user the process runs as."),
    Column("start_time", "TIMESTAMP", "When the process started (UTC)."),
    Column("rss", "BIGINT", "Resident memory, bytes."),
    Column("vms", "BIGINT", "Virtual memory, bytes."),
    Column("cpu_percent", "DOUBLE", "CPU use since the previous query of this table (first query: over 0.1 s)."),
    Column("num_threads", "INTEGER", "OS threads in the process."),
    Column("num_fds", "INTEGER", "Open file descriptors."),
    Column("python_version", "VARCHAR", "Python version, e.g. '3.11.7'."),
    Column("executable", "VARCHAR", "Path of the Python interpreter."),
    Column("python_traced_bytes", "BIGINT", "Bytes Python's allocators hold now (objects and the interpreter's own "
                                            "memory), where tracemalloc traces: the program started with "
                                            "PYTHONTRACEMALLOC=1 or -X tracemalloc (it slows allocation); NULL "
                                            "otherwise: Python's share of RSS is not known cheaply without it."),
)
EXAMPLE = "SELECT pid, rss / 1e6 AS rss_mb, cpu_percent, num_threads FROM process.info"

_process: Any = None
_process_lock = threading.Lock()


def rows() -> Iterator[Tuple[Any, ...]]:
    proc = _psutil_process()
    python_version = "%d.%d.%d" % sys.version_info[:3]
    if proc is None:
        yield (os.getpid(), os.getppid(), socket.gethostname(), _cmdline(sys.argv), os.getcwd(), None, None,
               None, None, None, threading.active_count(), _count_fds(), python_version, sys.executable,
               _python_traced())
        return
    with proc.oneshot():
        mem = proc.memory_info()
        started = datetime.datetime.fromtimestamp(proc.create_time(), datetime.timezone.utc).replace(tzinfo=None)
        row = (proc.pid, proc.ppid(), socket.gethostname(), _cmdline(proc.cmdline()), proc.cwd(), proc.username(),
               started, mem.rss, mem.vms, _cpu_percent(proc), proc.num_threads(), proc.num_fds(),
               python_version, sys.executable, _python_traced())
    yield row


def _python_traced() -> Optional[int]:
    """What tracemalloc counts now, where it traces (a builtin module: nothing is imported); else None."""
    try:
        import _tracemalloc

        if _tracemalloc.is_tracing():
            return int(_tracemalloc.get_traced_memory()[0])
    except Exception:  # an interpreter without it: said as not known
        pass
    return None


def _cmdline(args: List[str]) -> str:
    return " ".join(args if process_env.show_secrets else mask_argv(list(args)))


def _psutil_process() -> Any:
    global _process
    with _process_lock:
        if _process is None or _process.pid != os.getpid():
            try:
                import psutil  # imported on the first query of this table, never at agent start
            except ImportError:
                return None
            _process = psutil.Process()
            _process.cpu_percent(None)  # prime: the next call measures from here
            _process._probe_primed = True
        return _process


def _cpu_percent(proc: Any) -> Optional[float]:
    if getattr(proc, "_probe_primed", False):
        proc._probe_primed = False
        return float(proc.cpu_percent(0.1))
    return float(proc.cpu_percent(None))


def _count_fds() -> Optional[int]:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
