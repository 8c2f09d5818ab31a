"""``python.backtrace``: one row per frame of every thread, innermost frame first (depth 0)."""

import gc
import linecache
import operator
import sys
import threading
from typing import Any, Dict, List, Tuple

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
    Column("frame_type", "VARCHAR", "Kind of frame: 'python', or 'native' for a C/C++ frame (only in stacks read "
                                    "from outside with --native: backtrace --native, query --native)."),
    Column("code", "VARCHAR", "The source line being executed, stripped; NULL when the source is unavailable."),
)
EXAMPLE = "SELECT func, file, lineno, depth FROM python.backtrace ORDER BY depth LIMIT 10"

AGENT_THREAD_PREFIX = "probe-"


def is_agent_thread(thread: Any) -> bool:
    return thread is not None and str(getattr(thread, "name", "")).startswith(AGENT_THREAD_PREFIX)


def snapshot() -> Tuple[List[Tuple[Any, ...]], List[Tuple[str, str, int, Any]]]:
    """Every thread's stack as indices into a table of distinct frames.

    Threads of a training job share most of their stacks (workers, loaders), so a frame that appears
    in many threads is described, and its source line looked up, once. Returns ``(threads, frames)``:
    each thread is ``(thread_id, name, native_id, is_main, [frame index, innermost first])`` and each
    frame ``(func, file, lineno, code)``.

    The other threads' frames are read with the cyclic collector off and without anything that could
    let those threads run (no file reads: source lines are looked up afterwards, when no frame is
    held). Two CPython hazards make this necessary:

    * gh-106883 (fixed only in later 3.12 and 3.13 releases): ``sys._current_frames()`` holds the
      runtime's thread-list lock while it creates frame objects. A collection started there may run
      a finaliser that releases the GIL; a thread that then takes the GIL and wants the list lock (any
      thread starting or exiting) waits forever for ours, and ours for the GIL: the process freezes.
    * On 3.11, following ``f_back`` through another thread's frames while that thread runs on and
      exits crashed the target (SIGSEGV within a minute of six clients against threads that come and
      go, when a finaliser or a source-file read let the other threads run in the middle of the walk).

    (Should the target's own code switch the collector off in the bytecodes between, it would find it
    on again.)
    """
    me = threading.get_ident()
    threads: Dict[int, Any] = dict(threading._active)  # type: ignore[attr-defined]
    main_ident = threading.main_thread().ident
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        current = sys._current_frames()
        current.pop(me, None)  # our own frame holds ``current``: keeping it would make a reference cycle
        stacks, places = _walk(current, threads, main_ident)
        current.clear()  # the other threads' frames go now, on this thread, not in a later collection
    finally:
        if enabled:
            gc.enable()
    frames = [(func, file, lineno, _source(file, lineno)) for func, file, lineno in places]
    return stacks, frames


def _walk(current: Dict[int, Any], threads: Dict[int, Any],
          main_ident: Any) -> Tuple[List[Tuple[Any, ...]], List[Tuple[str, str, int]]]:
    """Each thread's chain of frames as indices into distinct (func, file, lineno): attribute reads only."""
    index: Dict[Tuple[Any, int], int] = {}
    places: List[Tuple[str, str, int]] = []
    stacks: List[Tuple[Any, ...]] = []
    frame: Any
    for ident, frame in current.items():
        thread = threads.get(ident)
        if is_agent_thread(thread):
            continue
        chain: List[int] = []
        while frame is not None:
            code = frame.f_code
            # Keyed by the instruction offset: reading it is cheap, while f_lineno decodes the line
            # table each time; the line is worked out once per distinct frame.
            key = (code, frame.f_lasti)
            position = index.get(key)
            if position is None:
                position = index[key] = len(places)
                places.append((getattr(code, "co_qualname", code.co_name), code.co_filename, frame.f_lineno or 0))
            chain.append(position)
            frame = frame.f_back
        stacks.append((ident, getattr(thread, "name", None), getattr(thread, "native_id", None),
                       ident == main_ident, chain))
    return stacks, places


def rows() -> Dict[str, List[Any]]:
    """The table, column by column (the registry's fastest form: no tuple per row)."""
    stacks, frames = snapshot()
    out: Dict[str, List[Any]] = {c.name: [] for c in COLUMNS}
    positions = [position for stack in stacks for position in stack[4]]
    if not positions:
        return out
    pick = operator.itemgetter(*positions) if len(positions) > 1 else (lambda values: (values[positions[0]],))
    for column, values in zip(("func", "file", "lineno", "code"), zip(*frames)):
        out[column] = list(pick(values))  # one C-level gather per column
    for ident, name, native, is_main, chain in stacks:
        count = len(chain)
        out["thread_id"] += [ident] * count
        out["thread_name"] += [name] * count
        out["native_id"] += [native] * count
        out["is_main"] += [is_main] * count
        out["depth"] += range(count)
    out["frame_type"] = ["python"] * len(positions)
    return out


def _source(file: str, lineno: int) -> Any:
    line = linecache.getline(file, lineno).strip()
    return line or None
