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

__all__ = ["fast_switching"]

_REQUEST_INTERVAL = 0.0005
_lock = threading.Lock()
_active = 0
_saved = 0.005


@contextmanager
def fast_switching() -> Iterator[None]:
    global _active, _saved
    with _lock:
        if _active == 0:
            _saved = sys.getswitchinterval()
            if _saved > _REQUEST_INTERVAL:
                sys.setswitchinterval(_REQUEST_INTERVAL)
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1
            if _active == 0:
                sys.setswitchinterval(_saved)
