"""A line of a source file as ``linecache.getline`` gives it, without importing ``linecache`` where it is not
loaded yet: it imports ``tokenize`` and with it ``re`` and ``enum``, some 4 ms of the start-up of
``probe PID backtrace`` of a process with no agent (whose frames' lines are shown).

Only the plain case is read here: an absolute path (linecache looks a relative one up on ``sys.path``) of a
file with no byte-order mark and no ``coding`` in its first two lines, which ``tokenize`` reads as strict
UTF-8; every other case, and every call once this process has imported ``linecache`` (its cache then holds
what was read), goes to ``linecache`` itself. Lines are split as a text file reads them (``\\r\\n`` and
``\\r`` end lines too); a file that is no UTF-8 has no lines, as for ``linecache``.
"""

from __future__ import annotations

import os
import sys

__all__ = ["getline"]

_read: dict = {}
"""The lines of each file read here, kept for the process's life as linecache keeps them."""


def getline(path: str, lineno: int) -> str:
    """``linecache.getline(path, lineno)``; OSError and ValueError (a NUL in the name) as it raises them."""
    if "linecache" not in sys.modules and os.path.isabs(path):
        lines = _read.get(path)
        if lines is None:
            lines = _lines(path)
        if lines is not None:
            _read[path] = lines
            return lines[lineno - 1] if 1 <= lineno <= len(lines) else ""
    import linecache

    return linecache.getline(path, lineno)


def _lines(path: str) -> list | None:
    """The file's lines where it is the plain case, [] where linecache would find none; None: ask linecache."""
    try:
        os.stat(path)
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:
        return []  # linecache: no such file (an absolute path is not looked up elsewhere), or unreadable
    if data.startswith(b"\xef\xbb\xbf") or b"coding" in b"\n".join(data.split(b"\n", 2)[:2]):
        return None  # a declared encoding: tokenize's rules decide
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return []
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines[-1] == "":
        lines.pop()  # the end of the last line, or an empty file
    return [line + "\n" for line in lines]
