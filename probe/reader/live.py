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


def read_live(pid: int, native: bool = False, stop: bool = True) -> Stacks:
    """Every thread of live process ``pid``; ``native`` adds C frames. With ``stop`` (the default) or
    ``native`` the process is stopped for the read (milliseconds), so that no stack is torn by a call or
    a return made while it is read: a busy recursion read running showed impossible stacks (a caller at
    a line that calls nothing) in 2 reads of 100, with a second busy thread 14. ``stop=False`` leaves it running, for the callers that
    count its threads' context switches around the read (a stop counts as one) and can tell by other
    means that no Python code ran meanwhile; ``Stacks.may_be_torn`` then says so."""
    if pyspy_source.binary() is None:
        return pystack_source.read_live(pid, native, stop)
    if native and proc.state(pid) == "T" and pystack_source.available():
        return pystack_source.read_live(pid, native, stop)
    try:
        return pyspy_source.read_live(pid, native, stop)
    except ReaderError as first:
        if proc.state(pid) in (None, "Z", "X"):
            raise
        if not native:
            if not stop or not first.message.startswith("py-spy could not read process"):
                raise  # refused (ptrace, no interpreter): a second read would be refused as well
            try:  # a stop that failed (a thread that ended while py-spy stopped them): read it running
                return pyspy_source.read_live(pid, native, stop=False)
            except ReaderError:
                raise first from None
        if not pystack_source.available():
            raise
        try:
            return pystack_source.read_live(pid, native, stop)
        except ReaderError:
            raise first from None
