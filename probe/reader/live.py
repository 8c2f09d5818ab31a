"""A live process's stacks from outside: first from its memory by probe itself (``probe.reader.memory``:
CPython 3.11, none of its threads running during the read, every thread named by ``threading``), else
py-spy where it is installed (thread names, short pauses), else pystack (see the source modules for why each).

With native frames, a stopped process (SIGSTOP, Ctrl-Z) is read by pystack: py-spy's ``--native``
waits for each thread to stop for it, which a stopped process never reports, and fails ("Failed to get
stack traces"). pystack reads it as it is, and leaves it stopped. A py-spy read with native frames that
fails for another reason is tried once more with pystack too.
"""

from typing import List, Optional, Tuple

from probe.errors import ReaderError
from probe.reader import proc, pyspy_source, pystack_source
from probe.reader.stacks import OutsideFrame, Stacks, ThreadStack

__all__ = ["read_live", "read_own", "available", "unread_words"]

OWN = "probe's memory reader"


def read_own(pid: int) -> Optional[Stacks]:
    """The stacks ``probe.reader.memory`` reads of ``pid``, or None where it cannot tell them for certain."""
    return _read_own(pid)[0]


def _read_own(pid: int) -> Tuple[Optional[Stacks], str]:
    """``read_own``'s answer, and why it is None (``probe.reader.memory.read``'s words)."""
    from probe import _paths
    from probe.reader import memory

    directory = _paths.runtime_dir()
    threads, why = memory.read(pid, None if _paths.runtime_dir_problem(directory) else directory)
    if threads is None:
        if why.startswith("not allowed"):
            why = "not allowed to read its memory: %s" % proc.ptrace_denied_reason(pid)[0]
        return None, why
    return Stacks(pid, memory.SOURCE, tuple(
        ThreadStack(native, ident, name, is_main, tuple(OutsideFrame(*frame) for frame in frames), False, False,
                    name.startswith("probe-"))
        for native, ident, name, is_main, frames in threads), None, {"native": False, "consistent": True, "live": True}), ""


def available() -> bool:
    return pyspy_source.binary() is not None or pystack_source.available()


def read_live(pid: int, native: bool = False, stop: bool = True) -> Stacks:
    """Every thread of live process ``pid``; ``native`` adds C frames. With ``stop`` (the default) or
    ``native`` the process is stopped for the read (milliseconds), so that no stack is torn by a call or
    a return made while it is read: a busy recursion read running showed impossible stacks (a caller at
    a line that calls nothing) in 2 reads of 100, with a second busy thread 14. ``stop=False`` leaves it running, for the callers that
    count its threads' context switches around the read (a stop counts as one) and can tell by other
    means that no Python code ran meanwhile; ``Stacks.may_be_torn`` then says so. Without ``native``, a
    read from memory in which no thread ran needs no stop (and makes no context switch in the target).

    The ReaderError raised where no reader could read carries ``tried``: (reader, why) for each reader,
    which ``unread_words`` puts in words."""
    tried: List[Tuple[str, str]] = []
    if not native:
        own, why = _read_own(pid)
        if own is not None:
            return own
        tried.append((OWN, why))
    try:
        return _read_by_tools(pid, native, stop)
    except ReaderError as failed:
        if pyspy_source.binary() is None:
            tried.append(("py-spy", "not installed"))
            tried.append(("pystack", failed.message if pystack_source.available() else "not installed"))
        else:
            tried.append(("py-spy", failed.message))
        failed.tried = tried  # type: ignore[attr-defined]
        raise


def unread_words(pid: int, failed: ReaderError, then: Optional[str] = None) -> Tuple[str, str]:
    """What to say where no reader could read live process ``pid`` (``failed``: ``read_live``'s error): that its
    stacks could not be read from outside and each reader's reason; and the hint: what would let one read
    it (py-spy installed, ptrace allowed), then ``then`` (the error's own hint: how to start an agent there)
    unless it offers the read from outside that just failed."""
    tried = getattr(failed, "tried", None) or [("the reader", failed.message)]
    words = "its stacks could not be read from outside: %s" % "; ".join("%s: %s" % pair for pair in tried)
    hints = []
    if ("py-spy", "not installed") in tried:
        hints.append("`pip install py-spy` lets probe read them from outside")
    if any("not allowed" in why or "ptrace" in why for _, why in tried) and proc.state(pid) is not None:
        hints.append(proc.ptrace_denied_reason(pid)[1])
    if then and "read from outside" not in then:
        hints.append(then)
    elif not hints:
        hints.append("`probe %d inject` starts an agent in it (or start the program with PROBE=1 in its environment)" % pid)
    return words, "; or ".join(hints)


def _read_by_tools(pid: int, native: bool, stop: bool) -> Stacks:
    """``read_live`` by py-spy or pystack."""
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
