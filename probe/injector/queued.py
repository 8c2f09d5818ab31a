"""A note that an injected agent's start is queued in a process and has not run yet.

When ``probe PID inject`` gives up waiting (a C call keeps the GIL, or the main thread runs no Python
code), the start it queued stays in the target and runs later. Until then nothing in the process can
say so, so the injector leaves this note beside the agent's socket; ``probe PID health`` and ``probe
list`` read it and tell the user the start is on its way instead of "no agent". The note names the
process by its pid and start time, so a later process with the same pid never inherits it, and it is
ignored once an agent answers.
"""

import json
import os
import time
from typing import NamedTuple, Optional

from probe import _paths
from probe._private_file import replace_private

__all__ = ["Queued", "note", "read", "clear"]

_MAX_BYTES = 4096


class Queued(NamedTuple):
    since: float
    """When the start was queued (wall clock, seconds since the epoch)."""
    why: str
    """What it waits for, in words (the C call that keeps the GIL, or the main thread's next Python code)."""


def _path(pid: int, socket: str) -> Optional[str]:
    try:
        ticks = _paths.process_start_ticks(str(pid))
    except (OSError, ValueError):
        return None
    return os.path.join(os.path.dirname(socket), "%d-%d.queued" % (pid, ticks))


def note(pid: int, socket: str, why: str) -> None:
    """Leave the note (owner-only, replaced atomically); a failure to write it is not the user's problem."""
    path = _path(pid, socket)
    if path is None:
        return
    body = json.dumps({"since": time.time(), "why": why[:1000]}).encode()
    replace_private(path, body)


def read(pid: int, socket: str) -> Optional[Queued]:
    """The note for this very process (pid and start time), or None; a malformed note is no note."""
    path = _path(pid, socket)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as handle:
            raw = json.loads(handle.read(_MAX_BYTES))
        return Queued(float(raw["since"]), str(raw["why"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def clear(pid: int, socket: str) -> None:
    path = _path(pid, socket)
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
