"""A live process's stacks from outside: py-spy where it is installed (thread names, short pauses),
else pystack (see the two source modules for why each).

With native frames, a stopped process (SIGSTOP, Ctrl-Z) is read by pystack: py-spy's ``--native``
waits for each thread to stop for it, which a stopped process never reports, and fails ("Failed to get
stack traces"). pystack reads it as it is, and leaves it stopped. A py-spy read with native frames that
fails for another reason is tried once more with pystack too.
"""

from probe.errors import ReaderError
from probe.reader import proc, pyspy_source, pystack_source
from probe.reader.stacks import Stacks

__all__ = ["read_live", "available"]


def available() -> bool:
    return pyspy_source.binary() is not None or pystack_source.available()


def read_live(pid: int, native: bool = False) -> Stacks:
    """Every thread of live process ``pid``; ``native`` adds C frames (the process is stopped briefly)."""
    if pyspy_source.binary() is None:
        return pystack_source.read_live(pid, native)
    if native and proc.state(pid) == "T" and pystack_source.available():
        return pystack_source.read_live(pid, native)
    try:
        return pyspy_source.read_live(pid, native)
    except ReaderError as first:
        if not native or not pystack_source.available() or proc.state(pid) is None:
            raise
        try:
            return pystack_source.read_live(pid, native)
        except ReaderError:
            raise first from None
