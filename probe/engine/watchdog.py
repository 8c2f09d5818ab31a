"""One thread that enforces every query's time limit.

A ``threading.Timer`` per query starts (and tears down) a thread each time, which cost about 0.6 ms of
a query that should take a few. The watchdog keeps a heap of deadlines and sleeps until the next one;
with none pending it waits without waking.
"""

import heapq
import itertools
import threading
import time
from typing import Callable, List, Optional, Set, Tuple

__all__ = ["Watchdog"]


class Watchdog:
    def __init__(self, name: str = "probe-watchdog") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, Callable[[], None]]] = []
        self._cancelled: Set[int] = set()
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def schedule(self, delay: float, action: Callable[[], None]) -> int:
        """Call ``action`` (on the watchdog's thread) after ``delay`` seconds unless cancelled."""
        ident = next(self._ids)
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + delay, ident, action))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return ident

    def cancel(self, ident: int) -> None:
        with self._cond:
            if any(entry[1] == ident for entry in self._heap):
                self._cancelled.add(ident)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                deadline, ident, action = self._heap[0]
                remaining = deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                heapq.heappop(self._heap)
                if ident in self._cancelled:
                    self._cancelled.discard(ident)
                    continue
            try:
                action()
            except Exception:
                pass  # an interrupt that comes too late must not end the watchdog
