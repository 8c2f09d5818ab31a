"""``python.locals`` read from outside a live process, for when its agent cannot answer (a C call keeps
the GIL, the process is stopped), exactly when a user needs them.

py-spy reads each frame's local variables out of the process's memory (``dump --locals``) and formats
the simple ones itself: numbers, strings, None, bools, short containers; any other object shows as its
class name and address. Nothing runs in the target, so no ``__repr__`` runs. Each value is parsed back
(as a Python literal, bounded) to give the row the type and the repr the agent would give, and is
masked as a record's locals are (``probe.tables.redact``: a secret-looking name hides its value, a
password inside any value is cut out). Every row says ``source = 'outside'``. The process is stopped for
the read, as for stacks (``probe.reader.live``), unless it is stopped already. Where py-spy is not
installed, and for a core file, pystack reads them (the same texts).
"""

import ast
import json
import re
import subprocess
from typing import Any, List, Optional, Tuple

from probe.errors import ReaderError
from probe.reader import proc

__all__ = ["read_locals", "read_core_locals", "rows_of", "describe", "SOURCE"]

SOURCE = "outside"
TIMEOUT_S = 20.0
MAX_REPR = 200  # as the agent's python.locals
MAX_PARSED = 1000  # longer texts are not parsed back (a literal that long is not a simple value)
MAX_FRAMES_PER_THREAD = 200
MAX_LOCALS_PER_FRAME = 500
MAX_ROWS = 50_000
MAX_OUTPUT = 64 << 20
_OBJECT = re.compile(r"^<([A-Za-z_][\w.]*) at 0x[0-9a-fA-F]+>$")


def read_locals(pid: int) -> List[Tuple[Any, ...]]:
    """Rows of ``python.locals`` (its column order, ``source`` last) of every thread but the agent's."""
    from probe.reader import pyspy_source

    exe = pyspy_source.binary()
    if exe is None:
        return _by_pystack(pid, None, None)
    stopped = proc.state(pid) in ("T", "t")
    argv = [exe, "dump", "--pid", str(pid), "--json", "--locals"] + (["--nonblocking"] if stopped else [])
    try:
        done = subprocess.run(argv, capture_output=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ReaderError("py-spy did not read the locals of process %d within %.0f s" % (pid, TIMEOUT_S)) from None
    except OSError as exc:
        raise ReaderError("cannot run %s: %s" % (exe, exc.strerror or exc)) from None
    if done.returncode != 0:
        raise pyspy_source._explain(pid, done.stderr.decode("utf-8", "replace"))
    if len(done.stdout) > MAX_OUTPUT:
        raise ReaderError("py-spy's answer for process %d is larger than %d MiB" % (pid, MAX_OUTPUT >> 20))
    try:
        raw = json.loads(done.stdout.decode("utf-8", "replace"))
    except ValueError:
        raise ReaderError("py-spy gave an answer that is not JSON for process %d" % pid) from None
    return rows_of(raw if isinstance(raw, list) else [], pid)


def read_core_locals(path: str, executable: Optional[str], pid: int) -> List[Tuple[Any, ...]]:
    """Rows of ``python.locals`` of the process a core file holds (``executable``: the one that made it)."""
    return _by_pystack(pid, path, executable)


def _by_pystack(pid: int, core: Optional[str], executable: Optional[str]) -> List[Tuple[Any, ...]]:
    from probe.reader import pystack_source

    engine = pystack_source._engine()
    off = engine.NativeReportingMode.OFF
    try:
        if core is None:
            threads = list(engine.get_process_threads(pid, stop_process=True, native_mode=off, locals=True))
        else:
            threads = list(engine.get_process_threads_for_core(core, executable, native_mode=off, locals=True))
    except Exception as exc:
        raise pystack_source._explain(exc, None if core else pid, core=core) from None
    names = proc.thread_names(pid) if core is None else {}
    shaped = []  # as py-spy writes them: innermost frame first, locals as name and text
    for thread in threads:
        tid = int(thread.tid)
        frames = [{"name": f.code.scope, "filename": f.code.filename, "line": int(f.code.location.lineno),
                   "locals": [{"name": str(k), "repr": str(v)} for part in (f.arguments, f.locals)
                              for k, v in dict(part).items()]} for f in thread.frames]
        frames.reverse()
        shaped.append({"thread_id": None, "os_thread_id": tid, "frames": frames,
                       "thread_name": "MainThread" if tid == pid else names.get(tid)})
    return rows_of(shaped, pid)


def rows_of(threads: List[Any], pid: int) -> List[Tuple[Any, ...]]:
    """py-spy's ``dump --json --locals`` threads -> rows, bounded; anything malformed is skipped."""
    from probe.tables.redact import mask_env_value

    out: List[Tuple[Any, ...]] = []
    for thread in threads:
        if not isinstance(thread, dict) or not isinstance(thread.get("frames"), list):
            continue
        name = thread.get("thread_name") if isinstance(thread.get("thread_name"), str) else None
        if name and name.startswith("probe-"):
            continue  # the agent's own threads, as python.locals leaves them out
        native_id = _int(thread.get("os_thread_id"))
        ident = _int(thread.get("thread_id"))
        ident = ident if ident is not None else native_id
        depth = 0
        for frame in thread["frames"][:MAX_FRAMES_PER_THREAD]:
            if not isinstance(frame, dict) or frame.get("module"):
                continue  # a native frame (its shared object): no Python locals
            func, file, line = str(frame.get("name"))[:512], str(frame.get("filename"))[:4096], _int(frame.get("line"))
            for local in (frame.get("locals") or [])[:MAX_LOCALS_PER_FRAME]:
                if len(out) >= MAX_ROWS:
                    return out
                if not isinstance(local, dict) or not isinstance(local.get("name"), str):
                    continue
                text = local.get("repr") if isinstance(local.get("repr"), str) else None
                kind, value = describe(text)
                if value is not None:
                    value = mask_env_value(local["name"], value)[0]
                out.append((ident, name, native_id == pid, depth, func, file, line, local["name"][:512], kind, value,
                            SOURCE))
            depth += 1
    return out


def describe(text: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """(type, value) of a value as py-spy formatted it: a literal is parsed back and shown as Python shows
    it (``"a"`` -> ``'a'``, type ``str``); an object py-spy shows as ``<Name at 0x...>`` has type ``Name``.
    py-spy's own marks are kept as they are: a container it cut (``[0, 1, ...]``), a tuple (it writes
    ``(1,)`` as ``(1)``), NaN and infinities; a value it could not read (``?``, a long string) is NULL."""
    if text is None or text.strip() in ("", "?"):
        return None, None
    text = text.strip()
    if text in _FLOATS:
        return "float", _FLOATS[text]
    found = _OBJECT.match(text)
    if found:
        return found.group(1), text
    kind = _CONTAINERS.get(text[0])
    if len(text) <= MAX_PARSED and "..." not in text:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
        else:
            if "(" in text:  # a tuple inside may be written wrong: keep py-spy's text
                return kind or type(value).__name__, _cut(text)
            return type(value).__name__, _cut(repr(value))
    return kind, _cut(text)


_FLOATS = {"NaN": "nan", "nan": "nan", "inf": "inf", "-inf": "-inf"}
_CONTAINERS = {"[": "list", "(": "tuple", "{": "dict"}


def _cut(text: str) -> str:
    return text if len(text) <= MAX_REPR else text[:MAX_REPR - 3] + "..."


def _int(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
