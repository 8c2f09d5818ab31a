"""``python.backtrace``: one row per frame of every thread, innermost frame first (depth 0)."""

import linecache
import sys
import threading
from typing import Any, Dict, Iterator, List, Tuple

from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "is_agent_thread"]

NAME = "python.backtrace"
DESCRIPTION = "One row per Python frame of every thread (but the agent's own), innermost frame first."
COLUMNS = (
    Column("thread_id", "BIGINT", "Python thread identifier (threading.get_ident())."),
    Column("thread_name", "VARCHAR", "Thread name, NULL for a thread that threading does not know."),
    Column("native_id", "BIGINT", "Operating-system thread id (as in top -H and /proc/PID/task)."),
    Column("is_main", "BOOLEAN", "True for the interpreter's main thread."),
    Column("depth", "INTEGER", "Position in the stack: 0 is the innermost frame, the one executing now."),
    Column("func", "VARCHAR", "Function name (qualified name on Python 3.11+)."),
    Column("file", "VARCHAR", "Source file of the frame's code."),
    Column("lineno", "INTEGER", "Line being executed in that file."),
    Column("frame_type", "VARCHAR", "Kind of frame: 'python' (native frames may come later)."),
    Column("code", "VARCHAR", "The source line being executed, stripped; NULL when the source is unavailable."),
)
EXAMPLE = "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"

AGENT_THREAD_PREFIX = "probe-"


def is_agent_thread(thread: Any) -> bool:
    return thread is not None and str(getattr(thread, "name", "")).startswith(AGENT_THREAD_PREFIX)


def rows() -> Iterator[Tuple[Any, ...]]:
    frames = sys._current_frames()
    threads: Dict[int, Any] = dict(threading._active)  # type: ignore[attr-defined]
    main_ident = threading.main_thread().ident
    for ident, frame in frames.items():
        thread = threads.get(ident)
        if is_agent_thread(thread) or ident == threading.get_ident():
            continue
        name = getattr(thread, "name", None)
        native = getattr(thread, "native_id", None)
        is_main = ident == main_ident
        for depth, (func, file, lineno) in enumerate(_walk(frame)):
            yield (ident, name, native, is_main, depth, func, file, lineno, "python", _source(file, lineno))


def _walk(frame: Any) -> List[Tuple[str, str, int]]:
    out: List[Tuple[str, str, int]] = []
    while frame is not None:
        code = frame.f_code
        out.append((getattr(code, "co_qualname", code.co_name), code.co_filename, frame.f_lineno or 0))
        frame = frame.f_back
    return out


def _source(file: str, lineno: int) -> Any:
    line = linecache.getline(file, lineno).strip()
    return line or None
