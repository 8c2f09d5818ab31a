"""A target whose main thread counts in a loop while short-lived threads start and exit.

Its garbage holds objects whose finalisers release the GIL (as a closing file, a pyarrow reader or a
CUDA tensor do), and it collects often: the conditions of CPython's gh-106883 lock-order deadlock,
which ``sys._current_frames()`` can enter. Records the longest gap between two iterations of its main
loop (``max_gap``), which tests read with eval: a freeze shows as a gap, or as no answer at all.
"""

import gc
import os
import sys
import threading
import time

state = {"count": 0, "max_gap": 0.0, "threads": 0}


class ReleasesTheGil:
    def __del__(self) -> None:
        time.sleep(0)  # a finaliser that lets other threads run


def short_lived() -> None:
    payload = [ReleasesTheGil()]
    payload.append(payload)  # garbage with a cycle: work for the collector
    time.sleep(0.002)


def churn() -> None:
    """Keeps about 8 threads alive, each for a few milliseconds: threads start and exit all the time."""
    workers = []
    while True:
        workers = [w for w in workers if w.is_alive()]
        while len(workers) < 8:
            worker = threading.Thread(target=short_lived, name="worker", daemon=True)
            worker.start()
            workers.append(worker)
            state["threads"] += 1
        time.sleep(0.0005)


def main_loop() -> None:
    if "--start" in sys.argv:  # interpreters without probe installed: PYTHONPATH has it, the .pth hook not
        import probe

        probe.start()
    gc.set_threshold(10)
    threading.Thread(target=churn, name="churn", daemon=True).start()
    print("READY", os.getpid(), flush=True)
    last = time.monotonic()
    while True:
        now = time.monotonic()
        gap = now - last
        if gap > state["max_gap"]:
            state["max_gap"] = gap
        last = now
        state["count"] += 1
        cycle = [state]
        cycle.append(cycle)  # garbage with a cycle: collections happen as they would in a real job
        if state["count"] % 1000 == 0:
            time.sleep(0.0005)


main_loop()
