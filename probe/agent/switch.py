"""Shorter GIL switch interval while a request runs.

A request thread competes for the GIL with the target's busy main thread; at the default 5 ms switch
interval every hand-over costs the agent up to 5 ms, and the main thread pauses as long when the agent
holds the GIL. For the length of a request the interval is lowered, then restored when the last
concurrent request ends.
"""

import sys
import threading
from typing import Iterator
from contextlib import contextmanager

__all__ = ["fast_switching", "begin", "end"]

_REQUEST_INTERVAL = 0.0005
_lock = threading.Lock()
_active = 0
_saved = 0.005


def begin() -> None:
    """A request starts: lower the switch interval (the first of concurrent requests saves it)."""
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = sys.getswitchinterval()
            if _saved > _REQUEST_INTERVAL:
                sys.setswitchinterval(_REQUEST_INTERVAL)
        _active += 1


def end() -> None:
    """A request ends: the last one restores the target's own switch interval."""
    global _active
    with _lock:
        _active -= 1
        if _active == 0:
            sys.setswitchinterval(_saved)


@contextmanager
def fast_switching() -> Iterator[None]:
    begin()
    try:
        yield
    finally:
        end()
