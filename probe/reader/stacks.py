"""Stacks read from outside a process: what every source (a live process, a core file, a crash record)
produces, and its rows of ``python.backtrace``.

Stdlib only: a crash record is read with nothing else installed. NamedTuples, not frozen dataclasses: a
process with no agent is read on the path of ``probe PID backtrace``, and the dataclasses module (it imports
inspect) with three classes made by it took some 4 ms of that command's start-up.
"""

from types import MappingProxyType
from typing import Any, List, Mapping, NamedTuple, Optional, Tuple

__all__ = ["OutsideFrame", "ThreadStack", "Stacks", "how_read", "TORN_WORDS"]

TORN_WORDS = "a thread that ran Python meanwhile may show a stack torn by a call or return made during the read"


class OutsideFrame(NamedTuple):
    func: str
    file: str
    lineno: int
    frame_type: str = "python"  # or "native"
    library: Optional[str] = None  # the shared object of a native frame


class ThreadStack(NamedTuple):
    """One thread, innermost frame first. ``thread_id`` is the Python ident where the source knows it
    (a crash record), else None; ``holds_gil`` is None where the source cannot tell."""

    native_id: Optional[int]
    thread_id: Optional[int]
    name: Optional[str]
    is_main: bool
    frames: Tuple[OutsideFrame, ...]
    holds_gil: Optional[bool] = None
    gc_collecting: bool = False
    is_agent: bool = False

    @property
    def top(self) -> Optional[OutsideFrame]:
        """The innermost Python frame (what the thread's Python code is doing now)."""
        return next((f for f in self.frames if f.frame_type == "python"), None)

    def where(self) -> str:
        """``func (file:line)`` of the innermost Python frame, for messages."""
        top = self.top
        if top is None:
            return "native code"
        return "%s (%s:%d)" % (top.func, _short(top.file), top.lineno)

    def label(self) -> str:
        return "%s %s" % (self.native_id if self.native_id is not None else "?",
                          '"%s"' % self.name if self.name else "")


_NO_FACTS: Mapping[str, Any] = MappingProxyType({})


class Stacks(NamedTuple):
    """Every thread of one process as read from outside it, and where the reading came from."""

    pid: Optional[int]
    source: str  # for people: "read from outside the live process by pystack", "core file ./core.1", ...
    threads: Tuple[ThreadStack, ...]
    python_version: Optional[str] = None
    facts: Mapping[str, Any] = _NO_FACTS  # source-specific: signal, executable, cause, ... (read only)

    @property
    def may_be_torn(self) -> bool:
        """Read from a live process left running: a stack may mix two moments of a thread."""
        return self.facts.get("consistent") is False

    def gil_holder(self) -> Optional[ThreadStack]:
        return next((t for t in self.threads if t.holds_gil), None)

    def program_threads(self) -> List[ThreadStack]:
        """The threads that are not the agent's own (python.backtrace leaves those out too)."""
        return [t for t in self.threads if not t.is_agent]

    def rows(self, with_agent: bool = False) -> List[Tuple[Any, ...]]:
        """Rows of ``python.backtrace``, in its column order.

        A thread whose Python ident is unknown gets its OS thread id as ``thread_id``: rows of one
        thread still group together, and ``native_id`` says which it is.
        """
        out = []
        for thread in (self.threads if with_agent else self.program_threads()):
            ident = thread.thread_id if thread.thread_id is not None else thread.native_id
            for depth, frame in enumerate(thread.frames):
                out.append((ident, thread.name, thread.native_id, thread.is_main, depth, frame.func, frame.file,
                            frame.lineno, frame.frame_type, _source_line(frame)))
        return out


def how_read(stop: bool, stopped: bool, native: bool) -> str:
    """How a live read went, for ``Stacks.source``: whether each stack is one the program was in."""
    if stopped:
        return "as it is, stopped (nothing in it moved during the read)"
    if stop:
        return "which stopped it for the read%s (every stack is one it was in)" % (" and its native frames" if native else "")
    return "without stopping it (%s)" % TORN_WORDS


def _source_line(frame: OutsideFrame) -> Optional[str]:
    if frame.frame_type != "python" or frame.lineno <= 0:
        return None
    import linecache

    try:
        line = linecache.getline(frame.file, frame.lineno).strip()
    except (OSError, ValueError):  # a file name that no file can have (a NUL in it, read from a core)
        return None
    return line or None


def _short(path: str) -> str:
    return path.rsplit("/", 1)[-1]
