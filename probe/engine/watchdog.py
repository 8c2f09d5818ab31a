"""One thread that enforces every query's time limit.

A ``threading.Timer`` per query starts (and tears down) a thread each time, which cost about 0.6 ms of
a query that should take a few. The watchdog keeps a heap of deadlines and sleeps until the next one;
with none pending it waits without waking. Entries hold no reference cycles: a cancelled entry, and
the cursor its action names, are freed at once, never by a later garbage collection.

Scheduling and cancelling wake the thread only when they must (a deadline earlier than the one it
sleeps towards): a cancelled deadline stays in the heap, without its action, until it comes due or the
heap is compacted. Two needless wake-ups a query showed when many queries arrive at once (a fan-out to
every rank): 256 agents hosted 8 to a process used 0.9-1.0 s of CPU for one query each without them,
1.1-1.3 s with them.
"""

import heapq
import itertools
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

from probe._threads import daemon_thread

__all__ = ["Watchdog"]

Action = Callable[[], None]
_SLACK = 64  # cancelled heap entries kept before a compaction (each a float and an int)


class Watchdog:
    def __init__(self, name: str = "probe-watchdog") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int]] = []
        self._actions: Dict[int, Tuple[Action, Optional[float]]] = {}  # live entries: action, repeat
        self._ids = itertools.count()
        self._thread: Optional[threading.Thread] = None

    def schedule(self, delay: float, action: Action, repeat: Optional[float] = None) -> int:
        """Call ``action`` (on the watchdog's thread) after ``delay`` seconds unless cancelled.

        With ``repeat``, call it again every ``repeat`` seconds until cancelled: DuckDB forgets an
        interrupt that arrives before its query starts executing, so a single one may come too early.
        """
        ident = next(self._ids)
        due = time.monotonic() + delay
        with self._cond:
            self._actions[ident] = (action, repeat)
            sooner = not self._heap or due < self._heap[0][0]
            heapq.heappush(self._heap, (due, ident))
            if self._thread is None or not self._thread.is_alive():
                self._thread = daemon_thread(self._run, self._name)
                self._thread.start()
            elif sooner:
                self._cond.notify()  # it sleeps towards a later deadline, or without one
        return ident

    def cancel(self, ident: int) -> None:
        """Forget a deadline (and the reference its action holds, e.g. to a cursor) without waking the
        thread; its heap entry goes when due, or when cancelled entries outnumber the live ones."""
        with self._cond:
            if self._actions.pop(ident, None) is not None and len(self._heap) > 2 * len(self._actions) + _SLACK:
                self._heap = [entry for entry in self._heap if entry[1] in self._actions]
                heapq.heapify(self._heap)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                due, ident = self._heap[0]
                remaining = due - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                heapq.heappop(self._heap)
                entry = self._actions.get(ident)
                if entry is None:
                    continue
                action, repeat = entry
                if repeat is None:
                    del self._actions[ident]
                else:
                    heapq.heappush(self._heap, (time.monotonic() + repeat, ident))
            try:
                action()
            except Exception:
                pass  # an interrupt that comes too late must not end the watchdog
            action = entry = None  # type: ignore[assignment]
