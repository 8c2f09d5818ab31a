"""A target whose main thread spins in pure Python, counting, so a test can prove its work never stopped.

``counter`` (a global of ``__main__``, read with ``probe PID eval counter``) grows by one per loop
iteration; ``max_gap`` is the longest time in seconds between two iterations, so a test can also see
how long the loop was held up. ``reset_gap()`` starts a new measurement window.
"""

import os
import time

counter = 0
max_gap = 0.0


def reset_gap() -> float:
    """Forget the longest gap seen so far; returns it."""
    global max_gap
    seen, max_gap = max_gap, 0.0
    return seen


def spin() -> None:
    global counter, max_gap
    clock = time.perf_counter
    last = clock()
    print("READY", os.getpid(), flush=True)
    while True:  # the busy loop: every iteration counts, and measures the pause since the previous one
        counter += 1
        now = clock()
        if now - last > max_gap:
            max_gap = now - last
        last = now


spin()
