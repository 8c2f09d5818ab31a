"""One thread that enforces every query's time limit.

A ``threading.Timer`` per query starts (and tears down) a thread each time, which cost about 0.6 ms of
a query that should take a few. The watchdog keeps a heap of deadlines and sleeps until the next one;
with none pending it waits without waking.
"""

import heapq
import itertools
import threading
import time
from typing import Callable, List, Optional, Tuple

__all__ = ["Watchdog"]


class Watchdog:
    def __init__(self, name: str = "probe-watchdog") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, Callable[[], None]]] = []
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
        """Forget a deadline (and the reference its action holds, e.g. to a cursor)."""
        with self._cond:
            kept = [entry for entry in self._heap if entry[1] != ident]
            if len(kept) != len(self._heap):
                heapq.heapify(kept)
                self._heap = kept
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                remaining = self._heap[0][0] - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)  # holding no action: a cancelled one is freed at once
                    continue
                action: Optional[Callable[[], None]] = heapq.heappop(self._heap)[2]
            try:
                if action is not None:
                    action()
            except Exception:
                pass  # an interrupt that comes too late must not end the watchdog
            action = None
