"""``python.locals``: one row per local variable of every frame of every thread (but the agent's own).

Two phases. First the frames are read as ``python.backtrace`` reads them (collector off, attribute
reads only, nothing that lets another thread run mid-walk), keeping only each frame's description and
its locals' values, never the frames. Then each value is described: its type from the type object
alone, and a short ``repr``. A ``repr`` runs the object's own code, so it is bounded in size (long
strings, bytes and containers are cut before they are formatted), never asked of objects whose
``repr`` is known to cost (tensors, arrays, data frames, modules: their shape, dtype and device
instead, found by type name without importing their library), and run on a helper thread that this
table waits for a bounded time: past it, the remaining values get no ``repr`` (NULL), and a helper
stuck in foreign code is left behind (at most one at a time). Runs in the target; stdlib only, 3.9+.
"""

import gc
import sys
import threading
import time
import types
from typing import Any, Dict, List, Optional, Tuple

from probe.tables.python_backtrace import is_agent_thread
from probe.tables.redact import mask_local, reading
from probe.tables.spec import Column
from probe._threads import daemon_thread

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "brief_repr"]

NAME = "python.locals"
DESCRIPTION = "One row per local variable of every Python frame of every thread, with its type and a short repr."
COLUMNS = (
    Column("thread_id", "BIGINT", "Python thread identifier (joins python.backtrace.thread_id)."),
    Column("thread_name", "VARCHAR", "Thread name, NULL for a thread that threading does not know."),
    Column("is_main", "BOOLEAN", "True for the interpreter's main thread."),
    Column("depth", "INTEGER", "Frame position as in python.backtrace: 0 is the innermost frame."),
    Column("func", "VARCHAR", "Function name of the frame (qualified name on Python 3.11+)."),
    Column("file", "VARCHAR", "Source file of the frame's code."),
    Column("lineno", "INTEGER", "Line the frame is executing."),
    Column("name", "VARCHAR", "Name of the local variable."),
    Column("type", "VARCHAR", "Type of its value, as module.qualname (builtins without a module)."),
    Column("value", "VARCHAR", "A short repr (at most %d characters; tensors and arrays as shape, dtype and "
                               "device); NULL when it was not computed in time. Below the eval scope, '********' "
                               "where the name looks secret (password, api_key, TOKEN...) and credentials "
                               "inside any value masked, as in process.env." % 200),
    Column("source", "VARCHAR", "'agent': read by the agent inside the process; 'outside': read from outside it "
                                "by py-spy while the agent could not answer (simple values only: numbers, strings, "
                                "None, bools, short containers; other objects as their class name)."),
)
EXAMPLE = "SELECT name, type, value FROM python.locals WHERE thread_name = 'MainThread' AND depth = 1"

MAX_REPR = 200
MAX_ITEMS = 8  # elements shown of a container
MAX_FRAMES_PER_THREAD = 200  # innermost first; deep recursion is cut
MAX_LOCALS_PER_FRAME = 500  # a module's top level can hold thousands of names
MAX_ROWS = 50_000
REPR_BUDGET_S = 2.0  # for all the values of one query

_stuck = threading.Event()  # set while a helper is stuck in someone's __repr__


def rows() -> List[Tuple[Any, ...]]:
    places, values = _read_frames()
    texts = _describe_all(values)
    shown = bool(getattr(reading, "shows_secrets", False))
    out = []
    for (place, name, value), text in zip(values, texts):
        if text is not None and not shown:
            text = mask_local(name, text)
        out.append(places[place] + (name, _type_name(value), text, "agent"))
    return out


def _read_frames() -> Tuple[List[Tuple[Any, ...]], List[Tuple[int, str, Any]]]:
    """(frame descriptions, [(frame index, name, value)]): the first phase, with the collector off."""
    me = threading.get_ident()
    threads: Dict[int, Any] = dict(threading._active)  # type: ignore[attr-defined]
    main_ident = threading.main_thread().ident
    places: List[Tuple[Any, ...]] = []
    values: List[Tuple[int, str, Any]] = []
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        current = sys._current_frames()
        current.pop(me, None)
        frame: Any
        for ident, frame in current.items():
            thread = threads.get(ident)
            if is_agent_thread(thread):
                continue
            depth = 0
            while frame is not None and depth < MAX_FRAMES_PER_THREAD and len(values) < MAX_ROWS:
                code = frame.f_code
                places.append((ident, getattr(thread, "name", None), ident == main_ident, depth,
                               getattr(code, "co_qualname", code.co_name), code.co_filename, frame.f_lineno))
                names = frame.f_locals
                count = 0
                for name, value in list(names.items()):
                    if count >= MAX_LOCALS_PER_FRAME or len(values) >= MAX_ROWS:
                        break
                    values.append((len(places) - 1, str(name), value))
                    count += 1
                names = None
                frame = frame.f_back
                depth += 1
        current.clear()
    finally:
        if enabled:
            gc.enable()
    return places, values


def _describe_all(values: List[Tuple[int, str, Any]]) -> List[Optional[str]]:
    """Short reprs, on a helper thread waited for at most REPR_BUDGET_S; None for those not done."""
    texts: List[Optional[str]] = [None] * len(values)
    if _stuck.is_set() or not values:
        return texts
    deadline = time.monotonic() + REPR_BUDGET_S

    def work() -> None:
        _stuck.set()
        for i, (_, _, value) in enumerate(values):
            if time.monotonic() > deadline:
                break
            texts[i] = brief_repr(value)
        _stuck.clear()

    helper = daemon_thread(work, "probe-repr")
    helper.start()
    helper.join(REPR_BUDGET_S + 0.5)
    return list(texts)  # a copy: a helper still running writes into the old list only


def _type_name(value: Any) -> str:
    kind = type(value)
    module = kind.__dict__.get("__module__") if isinstance(kind.__dict__.get("__module__"), str) else None
    name = kind.__qualname__ if isinstance(kind.__qualname__, str) else kind.__name__
    return name if module in (None, "builtins") else "%s.%s" % (module, name)


_SUMMARIES: Dict[Tuple[Any, str], str] = {  # (module, class) anywhere in the type's MRO -> how to show it without its own repr
    ("torch", "Tensor"): "tensor", ("torch._tensor", "Tensor"): "tensor",
    ("numpy", "ndarray"): "array",
    ("pandas.core.frame", "DataFrame"): "frame", ("pandas.core.series", "Series"): "frame",
    ("torch.nn.modules.module", "Module"): "module",
}


def _summary_kind(value: Any) -> Optional[str]:
    for klass in type(value).__mro__:
        kind = _SUMMARIES.get((klass.__dict__.get("__module__"), klass.__name__))
        if kind:
            return kind
    return None


def brief_repr(value: Any, level: int = 2) -> str:
    """A repr of at most MAX_REPR characters that never formats a large object whole; never raises."""
    try:
        return _cut(_brief(value, level))
    except BaseException as exc:  # a repr that raised (or was interrupted)
        return "<repr failed: %s>" % type(exc).__name__


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REPR else text[:MAX_REPR - 3] + "..."


def _brief(value: Any, level: int) -> str:
    kind = type(value)
    if value is None or kind in (bool, float, complex):
        return repr(value)
    if kind is int:
        return repr(value) if value.bit_length() < 600 else "<int of %d bits>" % value.bit_length()
    if kind is str:
        return repr(value[:MAX_REPR]) + ("..." if len(value) > MAX_REPR else "")
    if kind in (bytes, bytearray):
        return repr(value[:MAX_REPR]) + ("..." if len(value) > MAX_REPR else "")
    if kind in (list, tuple, set, frozenset, dict):
        return _container(value, kind, level)
    summary = _summary_kind(value)
    if summary is not None:
        return _summarise(value, summary)
    if kind.__repr__ is object.__repr__:
        return "<%s object>" % _type_name(value)
    if kind is types.MethodType:  # its repr holds its object's whole repr (a model's tree)
        return "<bound method %s of %s>" % (getattr(value.__func__, "__qualname__", "?"), _type_name(value.__self__))
    return repr(value)


def _container(value: Any, kind: type, level: int) -> str:
    brackets: Dict[Any, str] = {list: "[]", tuple: "()", set: "{}", frozenset: "{}", dict: "{}"}
    open_, close = brackets[kind][0], brackets[kind][1]
    if not value:
        return repr(value)
    if level <= 0:
        return "%s...%s (%d items)" % (open_, close, len(value))
    parts = []
    for i, item in enumerate(value.items() if kind is dict else value):
        if i >= MAX_ITEMS:
            parts.append("...(%d items)" % len(value))
            break
        if kind is dict:
            parts.append("%s: %s" % (_cut(_brief(item[0], level - 1)), _cut(_brief(item[1], level - 1))))
        else:
            parts.append(_cut(_brief(item, level - 1)))
        if sum(len(p) for p in parts) > MAX_REPR:
            parts.append("...(%d items)" % len(value))
            break
    text = open_ + ", ".join(parts) + ("," if kind is tuple and len(value) == 1 else "") + close
    return text if kind in (list, tuple, set, dict) else "frozenset(%s)" % text


def _summarise(value: Any, kind: str) -> str:
    name = type(value).__name__
    if kind == "tensor":
        return "%s(shape=%s, dtype=%s, device=%s)" % (name, list(value.shape), value.dtype, value.device)
    if kind == "array":
        return "%s(shape=%s, dtype=%s)" % (name, tuple(value.shape), value.dtype)
    if kind == "frame":
        return "%s(shape=%s)" % (name, tuple(value.shape))
    return "%s(%s)" % (name, value.extra_repr())  # a torch module: its own line, not its whole tree
