"""``THREAD:DEPTH``: naming one frame of a live thread, and the namespace a snippet sees there.

THREAD is a thread's name (``MainThread``, ``loader-0``), ``main``, or its ident or native id; DEPTH is
a position as ``python.backtrace`` counts it (0 = innermost) or a function's name (the innermost frame
running it: stable while the stack moves, which depths are not). On the thread that runs the snippet,
the agent's own frames are skipped, so depth 0 is where that thread was when the snippet began.

Another thread's frames are read as ``python.backtrace`` reads them: the cyclic collector off and
nothing but attribute reads while the chain is followed (see ``python_backtrace.snapshot``); what is
kept is the frame's globals and its locals, never the chain. Runs in the target; stdlib only, 3.9+.
"""

import gc
import os
import sys
import threading
from typing import Any, Dict, Optional, Tuple

from probe.errors import BadRequest, NotFound

__all__ = ["FrameSpec", "parse_frame", "frame_scope", "Scope", "LOCALS_WRITE_BACK"]

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Whether assignments through ``frame.f_locals`` reach the frame (PEP 667, Python 3.13).
LOCALS_WRITE_BACK = sys.version_info >= (3, 13)

FrameSpec = Tuple[str, str]  # (thread, depth or function name)


class Scope:
    """Where a snippet's names live: ``globals`` and, for a function's frame, its ``locals`` mapping."""

    def __init__(self, globals_: Dict[str, Any], locals_: Any = None, label: str = "__main__") -> None:
        self.globals = globals_
        self.locals = locals_
        self.label = label


def parse_frame(text: Any) -> FrameSpec:
    """``"MainThread:1"`` -> ("MainThread", "1"); a clear ``bad_request`` for anything else."""
    if not isinstance(text, str) or ":" not in text or len(text) > 300:
        raise BadRequest("give the frame as THREAD:DEPTH (e.g. MainThread:1, or MainThread:main for the "
                         "innermost frame of the function main)")
    thread, _, where = text.rpartition(":")
    if not thread or not where:
        raise BadRequest("give the frame as THREAD:DEPTH, got %r" % text)
    if where.isdigit() and int(where) > 100000:
        raise BadRequest("depth %s is beyond any stack" % where)
    return thread, where


def _thread_ident(name: str) -> int:
    threads = list(threading.enumerate())
    if name in ("main", "MainThread"):
        ident = threading.main_thread().ident
        if ident is not None:
            return ident
    if name.isdigit():
        for thread in threads:
            if str(thread.ident) == name or str(getattr(thread, "native_id", None)) == name:
                return thread.ident or 0
    matches = [t for t in threads if t.name == name]
    if len(matches) == 1:
        return matches[0].ident or 0
    if matches:
        raise BadRequest("%d threads are named %r" % (len(matches), name),
                         hint="name it by ident instead: %s" % ", ".join(str(t.ident) for t in matches))
    raise NotFound("no thread named %r" % name,
                   hint="the threads: %s" % ", ".join(sorted(repr(t.name) for t in threads
                                                         if not t.name.startswith("probe-")))[:400])


def _own_frame_start(frame: Any) -> Any:
    """Past the agent's own frames (and the snippet's) on the running thread."""
    while frame is not None and (frame.f_code.co_filename.startswith(_PACKAGE)
                                 or frame.f_code.co_filename.startswith("<probe-")):
        frame = frame.f_back
    return frame


def _pick(frame: Any, where: str) -> Tuple[Any, int]:
    """The frame at depth ``where`` (a number) or the innermost running function ``where``; (None, n) if absent."""
    depth = 0
    wanted = int(where) if where.isdigit() else -1
    while frame is not None:
        code = frame.f_code
        if depth == wanted or (wanted < 0 and where in (code.co_name, getattr(code, "co_qualname", None))):
            return frame, depth
        frame = frame.f_back
        depth += 1
    return None, depth


def frame_scope(spec: FrameSpec) -> Scope:
    """The globals and locals of the frame ``spec`` names, read now, on the calling thread."""
    thread, where = spec
    ident = _thread_ident(thread)
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        if ident == threading.get_ident():
            start = _own_frame_start(sys._getframe())
        else:
            current = sys._current_frames()
            start = current.pop(ident, None)
            current.clear()
        frame, count = _pick(start, where)
        start = None
        if frame is None:
            if where.isdigit():
                raise NotFound("thread %s has %d frames; there is no depth %s" % (thread, count, where),
                               hint="see the frames with `probe TARGET backtrace`")
            raise NotFound("no frame of function %r in thread %s" % (where, thread),
                           hint="see the frames with `probe TARGET backtrace`")
        code = frame.f_code
        label = "%s (%s:%s)" % (getattr(code, "co_qualname", code.co_name), code.co_filename, frame.f_lineno)
        globals_, locals_ = frame.f_globals, frame.f_locals
        frame = None
    finally:
        if enabled:
            gc.enable()
    if locals_ is globals_:
        return Scope(globals_, None, label)  # a module's top level: its namespace is its globals
    return Scope(globals_, locals_, label)


def note_unwritten(scope: Scope, before: Optional[Dict[str, int]]) -> str:
    """A line for stderr when the snippet assigned a frame's locals that this Python cannot write back."""
    if before is None or scope.locals is None or LOCALS_WRITE_BACK:
        return ""
    try:
        # A name an import in the snippet bound (``import __main__``) is the snippet's own: nothing of the
        # frame was meant to change, and what it does through the module (``__main__.x = 1``) does change.
        changed = sorted(k for k, v in scope.locals.items() if before.get(k) != id(v)
                         and not isinstance(v, type(sys)))
    except Exception:
        return ""
    if not changed:
        return ""
    return ("probe: on Python %d.%d a frame's local variables are read-only: %s changed only in the snippet's "
            "copy, not in %s (objects you mutate do change)\n"
            % (sys.version_info[0], sys.version_info[1], ", ".join(changed[:10]), scope.label))
