"""``python.threads``: every Python thread with its CPU time (``/proc`` on Linux, else psutil; by native id)."""

import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

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
    Column("cpu_user", "DOUBLE", "CPU seconds spent in user mode; NULL where it cannot be read."),
    Column("cpu_system", "DOUBLE", "CPU seconds spent in the kernel; NULL where it cannot be read."),
)
EXAMPLE = ("SELECT t.thread_name, t.cpu_user, count(*) AS frames FROM python.backtrace b "
           "JOIN python.threads t USING (thread_id) GROUP BY ALL ORDER BY t.cpu_user DESC")


def rows() -> Iterator[Tuple[Any, ...]]:
    cpu = _cpu_times_by_native_id()
    main = threading.main_thread()
    for thread in _all_threads():
        user, system = cpu.get(thread.native_id or -1, (None, None))
        yield (thread.ident, thread.native_id, thread.name, thread.daemon, thread.is_alive(),
               thread is main, is_agent_thread(thread), user, system)


def _all_threads() -> List[threading.Thread]:
    """Every thread threading knows. Not ``threading.enumerate()``: a debugger in the process (pydevd, for
    ``probe T debug``) rewrites it to hide the threads it counts as its own, probe's among them."""
    with threading._active_limbo_lock:  # type: ignore[attr-defined]
        return list(threading._active.values()) + list(threading._limbo.values())  # type: ignore[attr-defined]


def _cpu_times_by_native_id() -> Dict[int, Tuple[float, float]]:
    """CPU seconds (user, system) of the threads that threading knows, by native id.

    On Linux read from ``/proc/self/task/TID/stat`` for those threads only, one ``os.read`` each: the
    values psutil gives (ticks / ``SC_CLK_TCK``), without its walk over every task of the process (a
    training job has dozens the query never shows: DuckDB's, OpenMP's, CUDA's) nor a buffered file
    object per task (1.6 ms a query in a process of 85 tasks, against 0.2 ms). Elsewhere, psutil."""
    if os.path.isdir("/proc/self/task"):
        ticks = float(os.sysconf("SC_CLK_TCK"))
        out: Dict[int, Tuple[float, float]] = {}
        for thread in _all_threads():
            native = thread.native_id
            if native is None:
                continue
            times = _task_times(native, ticks)
            if times is not None:
                out[native] = times
        return out
    try:
        import psutil  # imported on the first query of this table, never at agent start
    except ImportError:
        return {}
    try:
        return {t.id: (t.user_time, t.system_time) for t in psutil.Process().threads()}
    except Exception:
        return {}


def _task_times(native_id: int, ticks: float) -> Optional[Tuple[float, float]]:
    """(user, system) CPU seconds of one task of this process; None when it is gone or unreadable."""
    try:
        fd = os.open("/proc/self/task/%d/stat" % native_id, os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    fields = raw[raw.rfind(b")") + 2:].split(b" ")  # the name (field 2) may hold spaces and parentheses
    try:
        return float(fields[11]) / ticks, float(fields[12]) / ticks  # fields 14 and 15: utime, stime
    except (IndexError, ValueError):
        return None
