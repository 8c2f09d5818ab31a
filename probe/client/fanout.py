"""One call against many agents at once: a bound on requests in flight, a per-call timeout (each
client's own) and an overall deadline, after which the answers in hand are returned and the rest are
named as unanswered. Worker threads are daemons: one stuck on a rank never holds up the answer nor
the exit of the command.

The bound counts only requests that are still young. Few requests at a time is fastest when the agents
answer quickly: with 1024 agents on one 2-core machine (bench/bench_fanout.py --in-flight-sweep), 8 to
32 in flight answered in 2.2 s where 256 took 2.44 s, the agents spending 3.7-3.9 ms of CPU a query
instead of 4.2 (fewer of them woke at once, with their caches cold). But a rank that does not answer
(hung, its GIL held, its host gone) would then hold a place until its timeout, and the ranks queued
behind it would wait for nothing. So a request unanswered after ``slow_after`` seconds stops counting:
another starts in its place, up to ``max_open`` requests open in all.
"""

import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Set, TypeVar

from probe.client.wording import option
from probe.errors import ProbeError, Timeout

__all__ = ["Outcome", "fan_out", "unanswered", "Progress", "SLOW_AFTER_S", "MAX_OPEN"]

Item = TypeVar("Item")
Progress = Callable[[int, int, List[int]], None]
"""Called about every 0.1 s while waiting: (answered, total, indices still waited for)."""

SLOW_AFTER_S = 0.25  # a request unanswered this long no longer holds one of the max_in_flight places
MAX_OPEN = 512  # requests open at once, slow ones included (each a thread and a socket here)
_TICK_S = 0.1


class Outcome(NamedTuple):
    value: Any
    error: Optional[ProbeError]
    seconds: float


def fan_out(items: Sequence[Item], work: Callable[[Item], Any], max_in_flight: int = 32, deadline: float = 10.0,
            progress: Optional[Progress] = None, slow_after: float = SLOW_AFTER_S,
            max_open: int = MAX_OPEN) -> List[Outcome]:
    """``work(item)`` for every item, at most ``max_in_flight`` young requests at a time (see the module's
    docstring); an outcome per item, in order.

    An item still running (or never started) at the deadline gets a ``Timeout``; its thread is left to
    finish on its own (its socket has its own timeout)."""
    total = len(items)
    outcomes: List[Optional[Outcome]] = [None] * total
    started: List[Optional[float]] = [None] * total
    running: Dict[int, float] = {}  # index -> when its request started, while it runs
    # Not a Condition: a Ctrl-C that lands while the main thread waits on one can leave its lock released
    # (CPython's wait reacquires it in a ``finally`` the KeyboardInterrupt cuts short), and the ``with``
    # then fails with "cannot release un-acquired lock" in place of the interrupt. A plain lock guards the
    # state and a second one, held until every answer is in, is what the main thread waits on.
    done = threading.Lock()
    all_in = threading.Lock()
    all_in.acquire()
    state = {"next": 0, "answered": 0, "workers": 0, "allowance": max(1, max_in_flight)}
    max_open = max(max_open, max_in_flight)
    end = time.monotonic() + deadline

    def worker() -> None:
        while True:
            with done:
                i = state["next"]
                if i >= total or time.monotonic() >= end or state["workers"] > state["allowance"]:
                    state["workers"] -= 1  # nothing left, too late, or a slow request came back: one too many
                    return
                state["next"] += 1
                started[i] = running[i] = time.monotonic()
            t0 = time.monotonic()
            try:
                outcome: Outcome = Outcome(work(items[i]), None, time.monotonic() - t0)
            except ProbeError as exc:
                outcome = Outcome(None, _without_frames(exc), time.monotonic() - t0)
            except Exception as exc:  # a bug, or something we did not translate: that rank's failure only
                outcome = Outcome(None, ProbeError("%s: %s" % (type(exc).__name__, exc)), time.monotonic() - t0)
            with done:
                outcomes[i] = outcome
                running.pop(i, None)
                state["answered"] += 1
                if state["answered"] == total:
                    all_in.release()

    def add_workers(count: int) -> None:
        """Start up to ``count`` workers; called with ``done`` held."""
        for _ in range(count):
            state["workers"] += 1
            try:
                threading.Thread(target=worker, name="probe-fanout", daemon=True).start()
            except RuntimeError:  # no more threads here: make do with those running
                state["workers"] -= 1
                return

    with done:
        add_workers(min(state["allowance"], total))
    while True:
        with done:
            now = time.monotonic()
            if state["answered"] == total or now >= end:
                result = list(outcomes)
                break
            slow = sum(1 for t in running.values() if now - t > slow_after)
            state["allowance"] = min(max(1, max_in_flight) + slow, max_open)
            unstarted = total - state["next"]
            add_workers(max(0, min(state["allowance"] - state["workers"], unstarted)))
            answered, waited = state["answered"], [i for i, o in enumerate(outcomes) if o is None]
        if progress is not None:
            progress(answered, total, waited)
        if all_in.acquire(timeout=max(0.0, min(_TICK_S, end - now))):
            all_in.release()  # every answer is in: the next turn ends the wait
    for i, outcome in enumerate(result):
        if outcome is None:
            result[i] = unanswered(started[i] is not None, deadline)
    return [o for o in result if o is not None]


def unanswered(started: bool, deadline: float) -> Outcome:
    """The outcome of an item with no answer at the deadline: asked (``started``) or never asked."""
    why = ("no answer within the deadline of %.1f s" % deadline if started
           else "not asked: the deadline of %.1f s passed first (raise %s)"
           % (deadline, option("--max-in-flight", "max_in_flight=")))
    return Outcome(None, Timeout(why, hint="raise %s, or look at it alone" % option("--deadline", "deadline=")), deadline)


def _without_frames(exc: ProbeError) -> ProbeError:
    """``exc`` kept for the answer without the frames of its traceback (nor of the errors it came from):
    they would keep alive, until the whole fan-out ends, whatever the failed request held (a large answer)."""
    seen: Set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return exc
