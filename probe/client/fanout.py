"""One call against many agents at once: a bound on requests in flight, a per-call timeout (each
client's own) and an overall deadline, after which the answers in hand are returned and the rest are
named as unanswered. Worker threads are daemons: one stuck on a rank never holds up the answer nor
the exit of the command."""

import threading
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, TypeVar

from probe.errors import ProbeError, Timeout

__all__ = ["Outcome", "fan_out", "Progress"]

Item = TypeVar("Item")
Progress = Callable[[int, int, List[int]], None]
"""Called about every 0.1 s while waiting: (answered, total, indices still waited for)."""


class Outcome(NamedTuple):
    value: Any
    error: Optional[ProbeError]
    seconds: float


def fan_out(items: Sequence[Item], work: Callable[[Item], Any], max_in_flight: int = 128, deadline: float = 10.0,
            progress: Optional[Progress] = None) -> List[Outcome]:
    """``work(item)`` for every item, at most ``max_in_flight`` at a time; an outcome per item, in order.

    An item still running (or never started) at the deadline gets a ``Timeout``; its thread is left to
    finish on its own (its socket has its own timeout)."""
    total = len(items)
    outcomes: List[Optional[Outcome]] = [None] * total
    done = threading.Condition()
    next_index = [0]
    started: List[Optional[float]] = [None] * total
    begin = time.monotonic()
    end = begin + deadline

    def worker() -> None:
        while True:
            with done:
                i = next_index[0]
                if i >= total or time.monotonic() >= end:
                    return
                next_index[0] += 1
                started[i] = time.monotonic()
            t0 = time.monotonic()
            try:
                outcome: Outcome = Outcome(work(items[i]), None, time.monotonic() - t0)
            except ProbeError as exc:
                outcome = Outcome(None, exc, time.monotonic() - t0)
            except Exception as exc:  # a bug, or something we did not translate: that rank's failure only
                outcome = Outcome(None, ProbeError("%s: %s" % (type(exc).__name__, exc)), time.monotonic() - t0)
            with done:
                outcomes[i] = outcome
                done.notify_all()

    for _ in range(max(1, min(max_in_flight, total))):
        threading.Thread(target=worker, name="probe-fanout", daemon=True).start()
    with done:
        while True:
            answered = sum(o is not None for o in outcomes)
            now = time.monotonic()
            if answered == total or now >= end:
                break
            if progress is not None:
                progress(answered, total, [i for i, o in enumerate(outcomes) if o is None])
            done.wait(min(0.1, end - now))
        result = list(outcomes)
    for i, outcome in enumerate(result):
        if outcome is None:
            why = ("no answer within the deadline of %.1f s" % deadline if started[i] is not None
                   else "not asked: the deadline of %.1f s passed first (raise --max-in-flight)" % deadline)
            result[i] = Outcome(None, Timeout(why, hint="raise --deadline, or look at it alone"), deadline)
    return [o for o in result if o is not None]
