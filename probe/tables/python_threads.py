"""``python.threads``: every Python thread with its CPU time (psutil, matched by native id)."""

import threading
from typing import Any, Dict, Iterator, Tuple

from probe.tables.python_backtrace import is_agent_thread
from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows"]

NAME = "python.threads"
DESCRIPTION = "Every Python thread that threading knows, with its OS thread id and CPU time."
COLUMNS = (
    Column("thread_id", "BIGINT", "Python thread identifier (joins python.backtrace.thread_id)."),
    Column("native_id", "BIGINT", "Operating-system thread id."),
    Column("thread_name", "VARCHAR", "Thread name."),
    Column("daemon", "BOOLEAN", "Whether the thread is a daemon thread."),
    Column("alive", "BOOLEAN", "Whether the thread is still running."),
    Column("is_main", "BOOLEAN", "True for the interpreter's main thread."),
    Column("is_agent", "BOOLEAN", "True for the probe agent's own threads."),
    Column("cpu_user", "DOUBLE", "CPU seconds spent in user mode; NULL when psutil is unavailable."),
    Column("cpu_system", "DOUBLE", "CPU seconds spent in the kernel; NULL when psutil is unavailable."),
)
EXAMPLE = ("SELECT t.thread_name, t.cpu_user, count(*) AS frames FROM python.backtrace b "
           "JOIN python.threads t USING (thread_id) GROUP BY ALL ORDER BY t.cpu_user DESC")


def rows() -> Iterator[Tuple[Any, ...]]:
    cpu = _cpu_times_by_native_id()
    main = threading.main_thread()
    for thread in threading.enumerate():
        user, system = cpu.get(thread.native_id or -1, (None, None))
        yield (thread.ident, thread.native_id, thread.name, thread.daemon, thread.is_alive(),
               thread is main, is_agent_thread(thread), user, system)


def _cpu_times_by_native_id() -> Dict[int, Tuple[float, float]]:
    try:
        import psutil  # imported on the first query of this table, never at agent start
    except ImportError:
        return {}
    try:
        return {t.id: (t.user_time, t.system_time) for t in psutil.Process().threads()}
    except Exception:
        return {}
