"""``python.locks``: the locks each thread waits for and holds, by the object, not by its name.

For every frame of the program's own code (not the standard library's, site-packages', nor probe's), the
``with`` blocks its line is inside (it holds those context managers), and, for a thread's innermost
frame, the ``with X:`` or ``X.acquire(`` on its line (it waits there). Each expression that is a plain
name or attribute chain (``guard``, ``self.state.guard``) is read from that frame's own namespace without
running any code of the program: locals, globals and builtins are dicts, attributes are taken from the
instance's ``__dict__``, its slots or its class's ``__dict__`` only (a property or ``__getattr__`` is
not called: the expression is then said unresolved). So two threads at ``with a:`` in two modules name
two locks, and ``self.lock`` of two objects two locks: ``lock_id`` tells them apart. An RLock's owner is
read from the object (its ``repr``, C code); a ``threading.Lock`` records none.

Two phases, as ``python.locals``: the frames are read with the collector off and nothing that lets
another thread run (attribute reads only), keeping each frame's namespaces, never the frames; then the
source files are parsed (bounded: files, bytes, a cache by path, size and time) and the expressions
resolved. Runs in the target: stdlib only, 3.9+.
"""

import ast
import gc
import os
import sys
import threading
import types
from typing import Any, Dict, List, Optional, Tuple

from probe.tables.python_backtrace import is_agent_thread
from probe.tables.spec import Column

__all__ = ["NAME", "DESCRIPTION", "COLUMNS", "EXAMPLE", "rows", "lock_state"]

NAME = "python.locks"
DESCRIPTION = ("The locks each thread waits for (its innermost frame at `with X:` or `X.acquire(`) and holds (its "
               "frames inside `with X:` blocks), by object identity.")
COLUMNS = (
    Column("thread_id", "BIGINT", "Python thread identifier (joins python.backtrace.thread_id)."),
    Column("thread_name", "VARCHAR", "Thread name."),
    Column("depth", "INTEGER", "Frame position as in python.backtrace: 0 is the innermost frame."),
    Column("func", "VARCHAR", "Function name of the frame."),
    Column("file", "VARCHAR", "Source file of the frame's code."),
    Column("lineno", "INTEGER", "Line the frame is executing."),
    Column("role", "VARCHAR", "'waits': the innermost frame is at this `with` or `acquire(` (blocked there, if it "
                              "stays); 'holds': the frame's line is inside this `with` block."),
    Column("expr", "VARCHAR", "The expression as written (`self.state.guard`)."),
    Column("with_line", "INTEGER", "The line of the `with` (or of the `acquire(` call)."),
    Column("lock_id", "BIGINT", "id() of the object the expression names in that frame (a Condition: its lock); NULL "
                                "where it is not a plain name or attribute chain, or not found without running code."),
    Column("lock_type", "VARCHAR", "The object's type (module.qualname); NULL where unresolved."),
    Column("locked", "BOOLEAN", "Whether the lock is taken now; NULL for an object that is not a known lock."),
    Column("owner", "BIGINT", "The thread id that owns an RLock (NULL for a Lock, which records none)."),
)
EXAMPLE = "SELECT thread_name, role, expr, lock_id, locked, owner, func, lineno FROM python.locks ORDER BY lock_id"

MAX_DEPTH = 100  # frames read per thread, innermost first
MAX_FILES = 64  # source files parsed in one query
MAX_SOURCE = 2 * 1024 * 1024
MAX_CACHE = 256
MAX_CHAIN = 8  # names in one attribute chain

_Blocks = Tuple[List[Tuple[int, int, int, int, List[ast.expr]]], List[Tuple[int, int, ast.expr]]]
_CACHE: Dict[str, Tuple[Tuple[int, int], Optional[_Blocks]]] = {}
_CACHE_LOCK = threading.Lock()
_MISSING = object()


def rows() -> List[Tuple[Any, ...]]:
    frames = _read_frames()
    out: List[Tuple[Any, ...]] = []
    parsed = 0
    for ident, name, depth, func, path, line, scopes in frames:
        blocks, fresh = _blocks(path, parsed < MAX_FILES)
        parsed += fresh
        if blocks is None:
            continue
        withs, acquires = blocks
        found: List[Tuple[str, int, ast.expr]] = []
        for start, header_end, body_start, end, items in withs:
            if body_start <= line <= end:
                found += [("holds", start, item) for item in items]
            elif depth == 0 and start <= line <= header_end:
                found += [("waits", start, item) for item in items]
        if depth == 0:
            found += [("waits", start, node) for start, end, node in acquires if start <= line <= end]
        for role, at, node in found:
            obj = _resolve(node, scopes)
            out.append((ident, name, depth, func, path, line, role, _text(node), at) + lock_state(obj))
    return out


def lock_state(obj: Any) -> Tuple[Optional[int], Optional[str], Optional[bool], Optional[int]]:
    """(lock_id, lock_type, locked, owner) of an object found by name; a Condition stands for its lock.
    Only C methods of the exact lock types are called (``locked()``, the RLock's ``repr``)."""
    if obj is _MISSING:
        return None, None, None, None
    kind = type(obj)
    if kind is threading.Condition:
        inner = _static_attr(obj, "_lock")
        if inner is not _MISSING:
            obj, kind = inner, type(inner)
    name = "%s.%s" % (getattr(kind, "__module__", "?"), getattr(kind, "__qualname__", kind.__name__))
    if kind is _LOCK:
        return id(obj), name, bool(obj.locked()), None
    if kind is _RLOCK:
        text = repr(obj)  # _thread.RLock's own C repr: "<locked _thread.RLock object owner=N count=M at 0x...>"
        owner = None
        if " owner=" in text:
            try:
                owner = int(text.split(" owner=", 1)[1].split()[0]) or None
            except ValueError:
                owner = None
        return id(obj), name, text.startswith("<locked"), owner
    if kind is _PY_RLOCK:
        owner = _static_attr(obj, "_owner")
        return id(obj), name, owner is not None and owner is not _MISSING, owner if isinstance(owner, int) else None
    return id(obj), name, None, None


_LOCK = type(threading.Lock())
_RLOCK = type(threading.RLock())
_PY_RLOCK = getattr(threading, "_PyRLock", None)


def _read_frames() -> List[Tuple[Any, ...]]:
    """(ident, thread name, depth, func, file, line, (locals, globals, builtins)) of the program's own frames."""
    me = threading.get_ident()
    threads: Dict[int, Any] = dict(threading._active)  # type: ignore[attr-defined]
    library = _library_roots()
    out: List[Tuple[Any, ...]] = []
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
            while frame is not None and depth < MAX_DEPTH:
                code = frame.f_code
                path = code.co_filename
                if not path.startswith("<") and not path.startswith(library):
                    names = frame.f_locals
                    if type(names) is not dict:  # 3.13's proxy holds the frame: a copy, read now
                        names = dict(names)
                    out.append((ident, getattr(thread, "name", None), depth, getattr(code, "co_qualname", code.co_name),
                                path, frame.f_lineno or 0, (names, frame.f_globals, frame.f_builtins)))
                    names = None
                frame = frame.f_back
                depth += 1
        current.clear()
    finally:
        if enabled:
            gc.enable()
    return out


_ROOTS: Optional[Tuple[str, ...]] = None


def _library_roots() -> Tuple[str, ...]:
    global _ROOTS
    if _ROOTS is None:
        from probe.tables.python_paths import rows as layout_rows

        skip = ("prefix", "base_prefix", "exec_prefix")
        _ROOTS = tuple(p.rstrip("/") + "/" for k, p in layout_rows() if k not in skip and p.startswith("/"))
    return _ROOTS


def _blocks(path: str, may_parse: bool) -> Tuple[Optional[_Blocks], int]:
    """The ``with`` statements of a file (start, last header line, body start, end, items) and its
    ``X.acquire(...)`` calls (start, end, X); from the cache while the file's size and time are the same."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None, 0
    stamp = (st.st_size, st.st_mtime_ns)
    with _CACHE_LOCK:
        cached = _CACHE.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1], 0
    if not may_parse:
        return None, 0
    out: Optional[_Blocks] = None
    if st.st_size <= MAX_SOURCE:
        try:
            with open(path, "rb") as handle:
                tree = ast.parse(handle.read())
            withs, acquires = [], []
            for node in ast.walk(tree):
                if isinstance(node, (ast.With, ast.AsyncWith)) and node.body:
                    body = node.body[0].lineno
                    withs.append((node.lineno, max(node.lineno, body - 1), body, node.end_lineno or body,
                                  [item.context_expr for item in node.items]))
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "acquire":
                    acquires.append((node.lineno, node.end_lineno or node.lineno, node.func.value))
            out = (withs, acquires)
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):
            out = None
    with _CACHE_LOCK:
        if len(_CACHE) >= MAX_CACHE:
            _CACHE.clear()
        _CACHE[path] = (stamp, out)
    return out, 1


def _text(node: ast.expr) -> str:
    try:
        return ast.unparse(node)[:200]
    except Exception:  # an expression unparse cannot write: its place still says where
        return "?"


def _resolve(node: ast.expr, scopes: Tuple[Any, Any, Any]) -> Any:
    """The object a plain name or attribute chain names in a frame's namespaces, found without running the
    program's code; ``_MISSING`` for anything else."""
    names: List[str] = []
    while isinstance(node, ast.Attribute) and len(names) < MAX_CHAIN:
        names.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return _MISSING
    obj: Any = _MISSING
    for scope in scopes:
        if type(scope) is dict and node.id in scope:
            obj = scope[node.id]
            break
    for attr in reversed(names):
        if obj is _MISSING:
            break
        obj = _static_attr(obj, attr)
    return obj


def _has(kind: type, name: str) -> bool:
    """Whether a type defines ``name``, by its classes' own dicts (``hasattr`` could run a metaclass's code)."""
    for klass in type.__dict__["__mro__"].__get__(kind):
        if name in type.__dict__["__dict__"].__get__(klass):
            return True
    return False


def _static_attr(obj: Any, name: str) -> Any:
    """``obj.name`` from the instance's ``__dict__`` or slots, or a plain value in its class's ``__dict__``;
    ``_MISSING`` where that would run code (a property, ``__getattr__``, a descriptor of the program's)."""
    try:
        mro = type.__dict__["__mro__"].__get__(type(obj))
        found: Any = _MISSING
        for klass in mro:
            space = type.__dict__["__dict__"].__get__(klass)
            if name in space:
                found = space[name]
                break
        if found is not _MISSING:
            kind = type(found)
            if kind is types.MemberDescriptorType:  # a slot: read by C code
                return found.__get__(obj, type(obj))
            if _has(kind, "__set__") or _has(kind, "__delete__"):
                return _MISSING  # a property or another data descriptor: its code would run
        holder: Any = _MISSING
        for klass in mro:
            space = type.__dict__["__dict__"].__get__(klass)
            if "__dict__" in space:
                holder = space["__dict__"]
                break
        if type(holder) in (types.GetSetDescriptorType, types.MemberDescriptorType):
            instance = holder.__get__(obj, type(obj))
            if type(instance) is dict and name in instance:
                return instance[name]
        if found is not _MISSING and not _has(type(found), "__get__"):
            return found
    except Exception:  # an object whose type does not behave: unresolved
        return _MISSING
    return _MISSING
