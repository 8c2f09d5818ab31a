"""A profile of several processes at once: start a capture on each, wait (bounded) until each has captured
its steps, fetch each one's trace, and merge them into one Chrome/Perfetto trace with one process per
rank on one clock. Each rank captures on its own (no collective); the clocks are lined up by each rank's
wall clock (the epoch its events count from), so ranks on hosts whose clocks disagree are off by that much.
"""

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

from probe.errors import Timeout

__all__ = ["wait_for_steps", "poll_interval", "merge_traces", "importing", "riding_imports", "POLL_S", "MIN_POLL_S",
           "IMPORT_PATIENCE_S"]

T = TypeVar("T")
POLL_S = 0.25
IMPORT_PATIENCE_S = 20.0
"""How long a rank busy importing a module (its agent kept from running) is asked again before it is named."""
MIN_POLL_S = 0.02
_ENDED = ("done", "failed", "cancelled", "off")


def wait_for_steps(poll: Callable[[], Dict[Any, Dict[str, Any]]], timeout: float,
                   progress: Optional[Callable[[Dict[Any, Dict[str, Any]]], None]] = None) -> Dict[Any, Dict[str, Any]]:
    """Poll every capture's status (``poll()``: key -> status) until each has ended, within ``timeout``
    seconds; ``Timeout`` names the ones still capturing and how far they got. Polls every ``POLL_S`` until
    a step has been seen captured, then every quarter of the shortest step seen (so that the end is seen
    soon after it comes), no more often than ``MIN_POLL_S`` and a little less often the more targets."""
    deadline = time.monotonic() + timeout
    seen: Dict[Any, Tuple[int, float]] = {}  # key -> (steps done, when first seen so)
    step_s: Optional[float] = None
    while True:
        statuses = poll()
        now = time.monotonic()
        for key, status in statuses.items():
            done, before = int(status.get("steps_done") or 0), seen.get(key)
            if before is None or done != before[0]:
                if before is not None and done > before[0]:
                    took = (now - before[1]) / (done - before[0])
                    step_s = took if step_s is None else min(step_s, took)
                seen[key] = (done, now)
        if progress is not None:
            progress(statuses)
        if all(s.get("state") in _ENDED for s in statuses.values()):
            return statuses
        if now >= deadline:
            behind = ["%s: %s, %s of %s steps" % (key, s.get("state"), s.get("steps_done"), s.get("steps"))
                      for key, s in sorted(statuses.items(), key=lambda kv: str(kv[0]))
                      if s.get("state") not in _ENDED]
            raise Timeout("the profile was not captured within %g s (%s)" % (timeout, "; ".join(behind[:8])),
                          hint="a capture waits for the job's optimizer steps: give --timeout more time, or "
                               "fewer --steps; the captures still running were cancelled")
        time.sleep(min(poll_interval(step_s, len(statuses)), max(0.0, deadline - time.monotonic())))


def importing(error: Optional[Exception]) -> bool:
    """Whether ``error`` says the rank's agent could not answer only because a program thread holds the GIL
    while importing a module (a lazy import in the training step, seconds on a loaded machine): a step
    that returns, so the rank is asked again rather than dropped from the profile."""
    diagnosis = getattr(error, "diagnosis", None)
    if diagnosis is None or getattr(diagnosis, "state", None) != "gil_held":
        return False
    holder = getattr(diagnosis, "holder", None)
    stacks = getattr(diagnosis, "stacks", None)
    if holder is None and stacks is not None:
        holder = stacks.gil_holder()
    if holder is None:
        return "while importing a module" in str(getattr(diagnosis, "message", ""))
    from probe.client.outside import _importing

    return _importing(holder)


def riding_imports(ask: Callable[[], T], patience_s: float = IMPORT_PATIENCE_S) -> T:
    """``ask()``, asked again every half second for up to ``patience_s`` while it fails only because a
    program thread of the rank is importing a module (:func:`importing`); any other error at once."""
    from probe.errors import ProbeError

    ends = time.monotonic() + patience_s
    while True:
        try:
            return ask()
        except ProbeError as exc:
            if not importing(exc) or time.monotonic() >= ends:
                raise
        time.sleep(0.5)


def poll_interval(step_s: Optional[float], targets: int) -> float:
    """Seconds until the next poll: a quarter of a step once one is known, within ``MIN_POLL_S`` (plus half
    a millisecond a target: 1,000 ranks are polled every ``POLL_S``) and ``POLL_S``."""
    if step_s is None:
        return POLL_S
    return min(POLL_S, max(MIN_POLL_S + 0.0005 * targets, step_s / 4))


def merge_traces(answers: Sequence[Tuple[int, Dict[str, Any]]]) -> Dict[str, Any]:
    """One Chrome trace from each rank's fetched capture: every event of rank R in process R ("rank R"), its
    time moved onto one clock (microseconds since the earliest event of any rank). What a rank cut is said
    in ``otherData``."""
    starts = []
    for _, answer in answers:
        timed = [e["ts"] for e in answer.get("traceEvents", []) if "ts" in e]
        if timed:
            starts.append(answer.get("epoch_us", 0.0) + min(timed))
    origin = min(starts) if starts else 0.0
    events: List[Dict[str, Any]] = []
    cut: Dict[str, int] = {}
    for rank, answer in sorted(answers, key=lambda pair: pair[0]):
        shift = answer.get("epoch_us", 0.0) - origin
        for event in answer.get("traceEvents", []):
            event = dict(event, pid=rank)
            if "ts" in event:
                event["ts"] = max(0.0, round(event["ts"] + shift, 3))  # epochs near 1.8e15 us: a 0.25 us grain
            if event.get("ph") == "M" and event.get("name") == "process_name":
                event["args"] = {"name": "rank %d" % rank}
            events.append(event)
        if answer.get("cut"):
            cut[str(rank)] = int(answer["cut"])
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"probe": {"ranks": [rank for rank, _ in answers], "events_cut": cut,
                                    "epoch_us": origin, "clock": "each rank's wall clock (time.time())"}}}

