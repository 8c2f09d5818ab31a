"""The threads probe starts inside a target: daemon threads that a debugger in the process leaves alone.

``probe T debug`` runs debugpy (pydevd) in the target. pydevd traces every thread it sees, and its trace
functions stay on a thread's frames after the debugger stops; an agent thread that later ran into one of
them could stop there for good (seen: the query watchdog stopped inside a trace call while holding its
lock, and every later query waited on it; and after a restart of debugpy, a thread the agent started
stopped at its first line inside pydevd's hook for new threads, holding the GIL). pydevd leaves alone a
thread marked as one of its own (``is_pydev_daemon_thread``, ``pydev_do_not_trace``): not traced, not
announced to the IDE, not paused with the rest at a breakpoint. Every thread of the agent is made here
with those marks, so an IDE attached to the target debugs the program, never probe's own threads. (pydevd
also hides such threads from ``threading.enumerate()``; probe's tables read ``threading._active``.)
Runs in the target: stdlib only.
"""

import threading
from typing import Any, Callable, Tuple

__all__ = ["daemon_thread"]


def daemon_thread(target: Callable[..., Any], name: str, args: Tuple[Any, ...] = ()) -> threading.Thread:
    """A daemon thread (not yet started) that debuggers in the process do not trace or suspend."""
    thread = threading.Thread(target=target, name=name, args=args, daemon=True)
    thread.pydev_do_not_trace = True  # type: ignore[attr-defined]  # both read by pydevd (debugpy)
    thread.is_pydev_daemon_thread = True  # type: ignore[attr-defined]
    return thread
