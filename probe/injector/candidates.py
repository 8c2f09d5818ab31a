"""Local Python processes that ``probe PID inject`` could attach to (what ``probe list`` shows)."""

import os
import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from probe.injector.target import expected_socket_path, read_target

__all__ = ["Candidate", "candidates"]

_PYTHON_NAME = re.compile(r"^python(\d(\.\d+)?)?$|^pypy")


@dataclass(frozen=True)
class Candidate:
    pid: int
    cmdline: Tuple[str, ...]
    user: str
    version: Optional[Tuple[int, int]]
    socket_path: str
    has_agent: bool
    """An agent socket exists for this pid (it may still be stale: ``probe PID inject`` checks it answers)."""

    @property
    def python_version(self) -> Optional[str]:
        return "%d.%d" % self.version if self.version else None


def candidates() -> List[Candidate]:
    """Python processes on this host that we can see, with whether an agent socket exists for them."""
    import psutil

    found: List[Candidate] = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "username", "uids"]):
        pid = proc.info["pid"]
        if pid == os.getpid():
            continue
        name = proc.info["name"] or ""
        cmdline = tuple(proc.info["cmdline"] or ())
        looks_python = _PYTHON_NAME.match(name) or (cmdline and "python" in os.path.basename(cmdline[0]))
        try:
            info = read_target(pid) if looks_python or _maps_libpython(pid) else None
        except OSError:
            info = None
        if info is None or not info.is_python:
            continue
        socket = expected_socket_path(pid, info.uid)
        found.append(Candidate(pid, cmdline, proc.info["username"] or str(info.uid), info.version, socket,
                               os.path.exists(socket)))
    return found


def _maps_libpython(pid: int) -> bool:
    """Embedded interpreters (uwsgi, a C++ trainer) show only in their mappings; readable for our own."""
    try:
        with open("/proc/%d/maps" % pid) as handle:
            return "libpython" in handle.read()
    except OSError:
        return False
