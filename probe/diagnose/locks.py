"""Who holds the lock a thread waits for, inferred from the stacks ``probe diagnose`` already has.

A ``threading.Lock`` records no owner, and an ``RLock``'s owner could only be read by running code in the
program, which diagnose does not do. What the stacks do tell: the lock's expression in the waiting line
(``with audit_lock:``, ``self._lock.acquire()``), and, for every other frame of the process, the ``with``
blocks its line is inside, read from the frame's source file here (parsed once, and only where the file's
line is the frame's code line as the agent read it, so a file that differs from the program's is not
used). A thread whose frame is inside ``with <the same expression>:`` holds it, by its stack. Locks taken
with ``acquire()`` and released later are not followed: their holder is said to be unknown.
"""

import ast
import os
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["waited_lock", "with_blocks", "holders"]

Key = Sequence[Tuple[str, str, int, str]]

MAX_SOURCE = 4 * 1024 * 1024  # a source file larger than this is not parsed
MAX_FILES = 64  # files parsed in one diagnose run at most

_PARSED: Dict[str, Optional[Tuple[List[str], ast.AST]]] = {}


def waited_lock(code: str) -> Optional[str]:
    """The lock expression of a waiting line: ``with X:`` -> ``X`` (the first item), ``X.acquire(...)`` -> ``X``."""
    text = (code or "").strip()
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


def holders(stacks: Dict[str, Key], waits: Sequence[Tuple[str, Key]]) -> List[Dict[str, object]]:
    """For each waiting thread: the lock it waits for and the thread that holds it by its stack, or why
    that is not known. ``stacks``: every thread's stack of the process (name -> frames innermost first)."""
    out: List[Dict[str, object]] = []
    for name, key in waits:
        lock = waited_lock(key[0][3]) if key else None
        row: Dict[str, object] = {"thread": name, "lock": lock, "holder": None}
        if lock is None:
            row["why"] = "the lock's expression is not read from `%s`" % (key[0][3] if key else "")
            out.append(row)
            continue
        from probe.diagnose.rules import _is_library

        unread = 0
        for other, frames in stacks.items():
            # the waiting thread's own outer frames count too: a threading.Lock taken twice by one thread
            for depth, (func, path, lineno, code) in enumerate(frames):
                if other == name and depth == 0 or _is_library(path):
                    continue  # the program's own frames only: a library's source is not parsed
                blocks = with_blocks(path, lineno, code)
                if blocks is None:
                    unread += 1
                    continue
                block = next((b for b in blocks if b[0] == lock), None)
                if block is not None:
                    row.update(holder=other, holder_func=func, holder_file=path, holder_with_line=block[1],
                               holder_line=lineno, holder_code=code)
                    break
            if row["holder"] is not None:
                break
        if row["holder"] is None:
            row["why"] = ("no thread's stack is inside a `with %s:` block (taken with acquire(), or by a frame "
                          "whose source is not readable here: %d frame%s); a threading.Lock records no owner"
                          % (lock, unread, "" if unread == 1 else "s"))
        out.append(row)
    return out
