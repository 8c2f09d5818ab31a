"""The straggler's samples of a diagnosis's first two looks, taken by the node helper right after the first.

``probe diagnose`` looks twice. Where a rank is stepping, each look carries ``SAMPLES`` more stacks of its
main thread, ``GAP_S`` apart (``probe.diagnose.straggler``): 0.4 s of waiting on the rank. At a first look
these followed the look; at the next they were taken first, in the wait between the looks (``"ahead"``).
But at thousands of ranks the first look itself outlasts that wait, so each helper spent 0.4 s at each
look before it could answer, and the client waited for the slowest, twice.

Here, a first look that asks for it (``"prefetch": true``) is answered without its samples, and each
stepping rank's samples of both looks are taken in the background as soon as its evidence is read; the
next look that names the rank ``ahead`` takes them (once, while fresh) instead of waiting for new ones.
As many samples in all, all of them between the two looks, which is what the rule reads them for.
Bounded: at most ``MAX_RUNNING`` ranks sampled at once and ``MAX_KEPT`` kept, each for ``KEEP_S``; a
sampler never raises and never holds up an answer.
"""

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, List, Optional, Tuple

__all__ = ["start", "take", "KEEP_S", "MAX_RUNNING", "MAX_KEPT"]

KEEP_S = 30.0
"""A diagnosis's second look comes within seconds of its first (its deadline is 10 s by default)."""
MAX_RUNNING = 64
MAX_KEPT = 1024

Key = Tuple[Any, int]  # (pid, rank)

_lock = threading.Lock()
_running: set = set()
_kept: "OrderedDict[Key, Tuple[float, Optional[List[Any]], threading.Event, float]]" = OrderedDict()


def start(key: Key, sample: Callable[[], List[Any]]) -> bool:
    """Take ``sample()`` for ``key`` in a daemon thread, unless one is under way or too many are; False
    where it was not started."""
    with _lock:
        if key in _running or len(_running) >= MAX_RUNNING:
            return False
        _running.add(key)
        done = threading.Event()
        began = time.monotonic()
        _kept.pop(key, None)
        _kept[key] = (began, None, done, began)
        while len(_kept) > MAX_KEPT:
            _kept.popitem(last=False)

    def run() -> None:
        got: Optional[List[Any]] = None
        try:
            got = sample()
        except Exception:  # noqa: BLE001 -- no samples kept: the next look takes its own
            got = None
        finally:
            with _lock:
                _running.discard(key)
                held = _kept.get(key)
                if held is not None and held[2] is done:
                    _kept[key] = (time.monotonic(), got, done, began)
            done.set()

    try:
        threading.Thread(target=run, name="probe-prefetch", daemon=True).start()
    except RuntimeError:  # no thread to be had: nothing kept
        with _lock:
            _running.discard(key)
            _kept.pop(key, None)
        return False
    return True


def take(key: Key, wait_s: float, not_before: Optional[float] = None) -> Optional[List[Any]]:
    """The samples kept for ``key`` (taken once; None where there are none, they are stale, they began
    before ``not_before`` (``time.monotonic()``: another diagnosis's, from before this one's first look), or
    they are not done within ``wait_s``)."""
    with _lock:
        held = _kept.get(key)
    if held is None or (not_before is not None and held[3] < not_before):
        return None
    if not held[2].wait(max(0.0, wait_s)):
        return None
    with _lock:
        held = _kept.pop(key, None)
    if held is None or not held[1] or time.monotonic() - held[0] > KEEP_S:
        return None  # none taken (the rank stopped answering meanwhile): the look takes its own
    return held[1]
