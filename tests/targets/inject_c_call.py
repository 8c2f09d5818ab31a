"""Injection target: the main thread is inside one long C call that holds the GIL.

``inject_c_call.py SECONDS``: after READY, ``sum(range(n))`` runs for about SECONDS without returning
to bytecode (no pending call, no thread switch), then the main thread sleeps in short naps. It prints
``RETURNED`` when the call is over.
"""

import os
import sys
import time


def calibrate(seconds: float) -> int:
    n = 1_000_000
    start = time.perf_counter()
    sum(range(n))
    per_item = (time.perf_counter() - start) / n
    return max(n, int(seconds / per_item))


def long_c_call(n: int) -> int:
    return sum(range(n))


if __name__ == "__main__":
    count = calibrate(float(sys.argv[1]) if len(sys.argv) > 1 else 3.0)
    print("READY", os.getpid(), flush=True)
    long_c_call(count)
    print("RETURNED", flush=True)
    while True:
        time.sleep(0.05)
