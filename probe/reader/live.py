"""A live process's stacks from outside: first from its memory by probe itself (``probe.reader.memory``:
CPython 3.11, none of its threads running during the read, every thread named by ``threading``), else
py-spy where it is installed (thread names, short pauses), else pystack (see the source modules for why each).

With native frames, a stopped process (SIGSTOP, Ctrl-Z) is read by pystack: py-spy's ``--native``
waits for each thread to stop for it, which a stopped process never reports, and fails ("Failed to get
stack traces"). pystack reads it as it is, and leaves it stopped. A py-spy read with native frames that
fails for another reason is tried once more with pystack too.
"""

from typing import Optional

from probe.errors import ReaderError
from probe.reader import proc, pyspy_source, pystack_source
from probe.reader.stacks import OutsideFrame, Stacks, ThreadStack

__all__ = ["read_live", "read_own", "available"]


def read_own(pid: int) -> Optional[Stacks]:
    """The stacks ``probe.reader.memory`` reads of ``pid``, or None where it cannot tell them for certain."""
    from probe import _paths
    from probe.reader import memory

    directory = _paths.runtime_dir()
    threads = memory.read_threads(pid, None if _paths.runtime_dir_problem(directory) else directory)
    if threads is None:
        return None
    return Stacks(pid, memory.SOURCE, tuple(
        ThreadStack(native, ident, name, is_main, tuple(OutsideFrame(*frame) for frame in frames), False, False,
                    name.startswith("probe-"))
        for native, ident, name, is_main, frames in threads), None, {"native": False, "consistent": True, "live": True})


def available() -> bool:
    return pyspy_source.binary() is not None or pystack_source.available()


def read_live(pid: int, native: bool = False, stop: bool = True) -> Stacks:
    """Every thread of live process ``pid``; ``native`` adds C frames. With ``stop`` (the default) or
    ``native`` the process is stopped for the read (milliseconds), so that no stack is torn by a call or
    a return made while it is read: a busy recursion read running showed impossible stacks (a caller at
    a line that calls nothing) in 2 reads of 100, with a second busy thread 14. ``stop=False`` leaves it running, for the callers that
    count its threads' context switches around the read (a stop counts as one) and can tell by other
    means that no Python code ran meanwhile; ``Stacks.may_be_torn`` then says so. Without ``native``, a
    read from memory in which no thread ran needs no stop (and makes no context switch in the target)."""
    if not native:
        own = read_own(pid)
        if own is not None:
            return own
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
