"""A live process's stacks from outside: py-spy where it is installed (thread names, short pauses),
else pystack (see the two source modules for why each)."""

from probe.reader import pyspy_source, pystack_source
from probe.reader.stacks import Stacks

__all__ = ["read_live", "available"]


def available() -> bool:
    return pyspy_source.binary() is not None or pystack_source.available()


def read_live(pid: int, native: bool = False) -> Stacks:
    """Every thread of live process ``pid``; ``native`` adds C frames (the process is stopped briefly)."""
    if pyspy_source.binary() is not None:
        return pyspy_source.read_live(pid, native)
    return pystack_source.read_live(pid, native)
