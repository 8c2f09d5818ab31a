"""Who holds the lock a thread waits for.

First by the lock's identity, from ``python.locks`` (the agent read each ``with`` and ``acquire(``
expression of the program's frames from that frame's own namespace, running none of its code): the
thread whose frame is inside a ``with`` of the same object holds it, and an RLock names its owner even
where it was taken with ``acquire()``. Where the agent did not say (an older agent, an expression that is
a call), by the stacks alone: the lock's expression in the waiting line (``with audit_lock:``,
``self._lock.acquire()``, comments left out), and, for every other frame of the process, the ``with``
blocks its line is inside, read from the frame's source file here (parsed once, and only where the file's
line is the frame's code line as the agent read it). A ``threading.Lock`` taken with ``acquire()`` records
no owner: its holder is said to be unknown.
"""

import ast
import io
import os
import tokenize
from typing import Any, Dict, List, Optional, Sequence, Tuple

from probe.diagnose.evidence import RankEvidence

__all__ = ["code_only", "waited_lock", "with_blocks", "holders"]

Key = Sequence[Tuple[str, str, int, str]]

MAX_SOURCE = 4 * 1024 * 1024  # a source file larger than this is not parsed
MAX_FILES = 64  # files parsed in one diagnose run at most

_PARSED: Dict[str, Optional[Tuple[List[str], ast.AST]]] = {}


def code_only(line: str) -> str:
    """A source line without its comment (``with a:  # first a`` -> ``with a:``); the line as it is where
    it does not tokenize alone (a line of a statement that spans several)."""
    text = (line or "").strip()
    if "#" not in text:
        return text
    try:
        for token in tokenize.generate_tokens(io.StringIO(text + "\n").readline):
            if token.type == tokenize.COMMENT:
                return text[:token.start[1]].rstrip()
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return text


def waited_lock(code: str) -> Optional[str]:
    """The lock expression of a waiting line: ``with X:`` -> ``X`` (the first item), ``X.acquire(...)`` -> ``X``."""
    text = code_only(code)
    try:
        if text.startswith(("with ", "async with ")) and text.endswith(":"):
            node = ast.parse(text + "\n    pass").body[0]
            if isinstance(node, (ast.With, ast.AsyncWith)) and node.items:
                return ast.unparse(node.items[0].context_expr)
            return None
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "acquire":
                return ast.unparse(node.func.value)
    except (SyntaxError, ValueError, RecursionError):
        return None
    return None


def _parsed(path: str) -> Optional[Tuple[List[str], ast.AST]]:
    if path in _PARSED:
        return _PARSED[path]
    out = None
    if len(_PARSED) < MAX_FILES and path.endswith(".py") and os.path.isfile(path):
        try:
            if os.path.getsize(path) <= MAX_SOURCE:
                with open(path, encoding="utf-8", errors="replace") as handle:
                    source = handle.read()
                out = (source.splitlines(), ast.parse(source))
        except (OSError, SyntaxError, ValueError, RecursionError):
            out = None
    _PARSED[path] = out
    return out


def with_blocks(path: str, line: int, code: str) -> Optional[List[Tuple[str, int]]]:
    """The context expressions of the ``with`` blocks whose body holds ``line`` of ``path`` (with the line
    of each ``with``), innermost last; None where the source cannot be read here or its line is not
    ``code`` (the line as the program runs it)."""
    parsed = _parsed(path)
    if parsed is None:
        return None
    lines, tree = parsed
    if not 1 <= line <= len(lines) or lines[line - 1].strip() != (code or "").strip():
        return None
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.body and \
                node.body[0].lineno <= line <= (node.end_lineno or 0):
            out += [(ast.unparse(item.context_expr), node.lineno) for item in node.items]
    return sorted(out, key=lambda item: item[1])


def holders(ev: RankEvidence, waits: Sequence[Tuple[str, Key]]) -> List[Dict[str, object]]:
    """For each waiting thread: the lock it waits for and the thread that holds it, or why that is not
    known. By the lock's identity where the agent resolved it (``python.locks``: an RLock's owner, or a
    frame inside a ``with`` of the same object), else by the expression's text in the stacks' source."""
    out: List[Dict[str, object]] = []
    names = ev.names_by_id()
    stacks = ev.stacks()
    library = ev.library()
    for name, key in waits:
        row = _by_identity(ev.lock_rows(), names, stacks, library, name, key)
        if row is None:
            row = _by_text(stacks, library, name, key)
        out.append(row)
    return out


def _by_identity(rows: List[Dict[str, Any]], names: Dict[int, str], stacks: Dict[str, Key], library: Any,
                 name: str, key: Key) -> Optional[Dict[str, object]]:
    if not key:
        return None
    waiting = [r for r in rows if r.get("role") == "waits" and names.get(r.get("thread_id")) == name
               and r.get("depth") == 0 and r.get("lineno") == key[0][2] and r.get("lock_id") is not None]
    if not waiting:
        return None
    # ``with a, b:``: the one taken by another (an RLock this thread owns does not block it)
    chosen = next((r for r in waiting if r.get("locked") and names.get(r.get("owner")) != name), waiting[0])
    lock_id = chosen["lock_id"]
    row: Dict[str, object] = {"thread": name, "lock": chosen.get("expr"), "lock_type": chosen.get("lock_type"),
                              "holder": None, "how": "by the lock's identity"}
    inside = sorted((r for r in rows if r.get("role") == "holds" and r.get("lock_id") == lock_id
                     and names.get(r.get("thread_id")) is not None), key=lambda r: (r.get("depth") or 0))
    owner = names.get(chosen.get("owner")) if chosen.get("owner") is not None else None
    if owner is not None:
        inside = [r for r in inside if names.get(r.get("thread_id")) == owner] or []
        row["how"] = "the RLock's owner"
    if inside:
        top = inside[0]
        row.update(holder=names[top["thread_id"]], holder_func=top.get("func"), holder_file=top.get("file"),
                   holder_with_line=top.get("with_line"), holder_line=top.get("lineno"), holder_expr=top.get("expr"))
    elif owner is not None:  # taken with acquire(): where its owner's own code is now
        frames = stacks.get(owner) or ()
        top_frame = next((f for f in frames if not library.holds(f[1])), frames[0] if frames else ("?", "?", 0, ""))
        row.update(holder=owner, holder_func=top_frame[0], holder_file=top_frame[1], holder_line=top_frame[2],
                   holder_with_line=None)
    else:
        row["why"] = ("no thread's frame is inside a `with` of this %s (taken with acquire()), and a threading.Lock "
                      "records no owner" % (chosen.get("lock_type") or "lock"))
    return row


def _by_text(stacks: Dict[str, Key], library: Any, name: str, key: Key) -> Dict[str, object]:
    lock = waited_lock(code_only(key[0][3])) if key else None
    row: Dict[str, object] = {"thread": name, "lock": lock, "holder": None, "how": "by its stack"}
    if lock is None:
        row["why"] = "the lock's expression is not read from `%s`" % (key[0][3] if key else "")
        return row
    unread = 0
    for other, frames in stacks.items():
        # the waiting thread's own outer frames count too: a threading.Lock taken twice by one thread
        for depth, (func, path, lineno, code) in enumerate(frames):
            if other == name and depth == 0 or library.holds(path):
                continue  # the program's own frames only: a library's source is not parsed
            blocks = with_blocks(path, lineno, code)
            if blocks is None:
                unread += 1
                continue
            block = next((b for b in blocks if b[0] == lock), None)
            if block is not None:
                row.update(holder=other, holder_func=func, holder_file=path, holder_with_line=block[1],
                           holder_line=lineno, holder_code=code)
                return row
    row["why"] = ("no thread's stack is inside a `with %s:` block (taken with acquire(), or by a frame whose source "
                  "is not readable here: %d frame%s); a threading.Lock records no owner"
                  % (lock, unread, "" if unread == 1 else "s"))
    return row
