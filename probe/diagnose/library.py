"""Which frames are a library's and which are the program's own, by the paths the target itself reports.

A verdict's ``where`` names the innermost frame and, where that frame is a library's (threading, torch,
probe's own agent), the innermost frame of the program's own code that called it. What counts as a
library is decided from the interpreter's own layout: its prefixes, standard library, site-packages
(``python.paths``, read from the agent), and probe's own package directory; never from a folder's name,
so that a project kept in a folder called ``probe`` (or ``lib``) is the program's own code.

Where the agent cannot answer (stacks read from outside), the layout is read from the process: its
executable (``/proc/PID/exe``) and the ``libpython`` it maps give the prefix and so the standard library.
Where nothing is known (a record from an older probe), only the install locations every interpreter
shares (``site-packages``, ``dist-packages``, ``lib/pythonX.Y``) count, with this host's own layout.
"""

import os
import re
from typing import Iterable, List, Optional, Sequence, Tuple

__all__ = ["Library", "local_layout", "from_process", "PATH_KINDS"]

PATH_KINDS = ("prefix", "base_prefix", "exec_prefix", "stdlib", "platstdlib", "purelib", "platlib", "site",
              "user_site", "probe")
"""The kinds of path ``python.paths`` reports; ``prefix``/``base_prefix``/``exec_prefix`` are said, not
used as roots (a project may live under a prefix, as /usr/src does under /usr)."""

ROOT_KINDS = frozenset(PATH_KINDS) - {"prefix", "base_prefix", "exec_prefix"}
MAX_ROOTS = 64
MAX_ROOT_LEN = 4096
_INSTALLED = re.compile(r"/(site-packages|dist-packages)/")
_STDLIB = re.compile(r"/lib(64)?/python\d+\.\d+t?/")  # only where the target's layout is not known


class Library:
    """The directories whose files are library code for one process (its roots), and the decision."""

    def __init__(self, roots: Iterable[str] = (), known: bool = False) -> None:
        cleaned = []
        for root in roots:
            if isinstance(root, str) and 1 < len(root) <= MAX_ROOT_LEN and root.startswith("/"):
                cleaned.append(root.rstrip("/"))
            if len(cleaned) >= MAX_ROOTS:
                break
        self.roots: Tuple[str, ...] = tuple(sorted(set(cleaned), key=len, reverse=True))
        self.known = known

    def holds(self, path: str) -> bool:
        """Whether ``path`` (a frame's file) is a library's: under one of the roots, frozen or generated
        code (``<frozen importlib._bootstrap>``), in a ``site-packages`` or ``dist-packages`` (what pip
        installs), or, where the target's layout is not known, in a ``lib/pythonX.Y``."""
        if not path or path.startswith("<"):
            return True
        if any(path.startswith(root + "/") for root in self.roots):
            return True
        return bool(_INSTALLED.search(path)) or not self.known and bool(_STDLIB.search(path))

    def __repr__(self) -> str:
        return "Library(%d roots, known=%s)" % (len(self.roots), self.known)


def from_rows(rows: Sequence[Tuple[str, str]]) -> Library:
    """The target's own layout, from the rows of ``python.paths`` it answered."""
    return Library((str(p) for k, p in rows if k in ROOT_KINDS), known=bool(rows))


def local_layout() -> Library:
    """This process's own layout: the fallback where the target's is not known (its probe is likely this one,
    its interpreter often this one), with the shared install locations :meth:`Library.holds` adds."""
    from probe.tables.python_paths import rows as layout_rows

    return Library((p for k, p in layout_rows() if k in ROOT_KINDS), known=False)


def from_process(pid: Optional[int], executable: Optional[str] = None) -> List[str]:
    """The library roots of a live process on this host read from outside: the standard library beside the
    executable it runs and beside the ``libpython`` it maps (``PREFIX/lib/pythonX.Y``); [] where unreadable."""
    candidates = []
    if pid is not None:
        try:
            candidates.append(os.readlink("/proc/%d/exe" % pid))
        except OSError:
            pass
        try:
            with open("/proc/%d/maps" % pid, "rb") as handle:
                for line in handle.read(8 << 20).decode("utf-8", "replace").splitlines():
                    path = line.split(None, 5)[5] if len(line.split(None, 5)) == 6 else ""
                    if re.search(r"/libpython\d+\.\d+[^/]*\.so", path):
                        candidates.append(path)
        except OSError:
            pass
    if executable:
        candidates.append(executable)
    roots: List[str] = []
    for path in candidates:
        path = path[:-len(" (deleted)")] if path.endswith(" (deleted)") else path
        prefix = os.path.dirname(os.path.dirname(path))
        lib = os.path.join(prefix, "lib")
        try:
            names = os.listdir(lib)
        except OSError:
            continue
        roots += [os.path.join(lib, n) for n in names if re.fullmatch(r"python\d+\.\d+t?", n)]
    return sorted(set(roots))
