"""Bounds on what requests may take from the target: memory held by results, and concurrent work.

Without them, 32 clients that each ask for a 100 MB result and never read it held 5 GB of the
target's memory, and a dozen concurrent queries left its main thread a small share of the GIL.

* ``ResultBudget``: the bytes held by results being built, encoded and sent, across all requests.
  A result grows its hold as it is read; past the budget it is refused at once as ``busy`` (waiting
  would keep a work slot from others). Small results (under ``free_bytes``) are never refused, so a
  flood of large ones cannot lock out an ordinary query.
* ``work_slot``: at most ``MAX_WORKERS`` requests produce tables or run SQL at a time; the others
  wait their turn (bounded), and the target's own threads keep most of the GIL.

Stdlib only; runs in the target.
"""

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from probe.errors import Busy

__all__ = ["ResultBudget", "Hold", "work_slot", "MAX_WORKERS"]

MAX_WORKERS = 2
_workers = threading.BoundedSemaphore(MAX_WORKERS)


@contextmanager
def work_slot(wait: float) -> Iterator[None]:
    """One of the few slots for GIL-heavy work (tables, SQL, encoding); ``Busy`` after ``wait`` s."""
    if not _workers.acquire(timeout=max(wait, 0.0)):
        raise Busy("%d other requests are being worked on in this process" % MAX_WORKERS,
                   hint="retry in a moment; the agent serves a few at a time to leave the target its CPU")
    try:
        yield
    finally:
        _workers.release()


class ResultBudget:
    def __init__(self, total_bytes: int, free_bytes: int = 1 << 20, wait: float = 0.0) -> None:
        self.total_bytes = total_bytes
        self.free_bytes = free_bytes
        self._wait = wait
        self._used = 0
        self._cond = threading.Condition()

    @property
    def used(self) -> int:
        return self._used

    def hold(self) -> "Hold":
        return Hold(self)

    def _grow(self, current: int, wanted: int) -> None:
        extra = wanted - current
        if extra <= 0:
            return
        deadline = time.monotonic() + self._wait
        with self._cond:
            while wanted > self.free_bytes and self._used + extra > self.total_bytes:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Busy("the agent holds %.0f MB of results for other requests (its bound is %.0f MB)"
                               % (self._used / 1e6, self.total_bytes / 1e6),
                               hint="retry when they are done; ask for a smaller result (LIMIT, aggregate)")
                self._cond.wait(remaining)
            self._used += extra

    def _shrink(self, amount: int) -> None:
        with self._cond:
            self._used -= amount
            self._cond.notify_all()


class Hold:
    """The bytes one request holds; ``reserve`` grows it, ``release`` gives it all back (idempotent)."""

    def __init__(self, budget: ResultBudget) -> None:
        self._budget = budget
        self.size = 0

    def reserve(self, size: int) -> None:
        """Hold ``size`` bytes in all (not more): raises ``Busy`` when the budget has no room."""
        self._budget._grow(self.size, size)
        self.size = max(self.size, size)

    def release(self) -> None:
        """Give the bytes back; after a large result, hand the freed memory back to the system too."""
        size, self.size = self.size, 0
        if size:
            self._budget._shrink(size)
        if size >= _TRIM_AFTER:
            _return_memory()


_TRIM_AFTER = 8 << 20


def _return_memory() -> None:
    """glibc keeps freed memory in its arenas (a killed client's 400 MB stayed for good); trim them."""
    from probe.engine.memory import return_memory

    return_memory()
