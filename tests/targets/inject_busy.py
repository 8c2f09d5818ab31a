"""Injection target: the main thread runs a pure-Python loop and records its longest pause.

``inject_busy.py [GAP_FILE]``: whenever the longest gap between two loop iterations grows, it is
written (in milliseconds) to GAP_FILE, so a bench can read how long an injection stalled the loop.
"""

import os
import sys
import time


def busy_loop(gap_file: str) -> None:
    longest = 0.0
    last = time.perf_counter()
    while True:
        for _ in range(200):
            pass
        now = time.perf_counter()
        gap = now - last
        last = now
        if gap > longest:
            longest = gap
            if gap_file:
                with open(gap_file + ".tmp", "w") as handle:
                    handle.write("%.3f\n" % (gap * 1000))
                os.replace(gap_file + ".tmp", gap_file)
                last = time.perf_counter()  # the write itself is not a pause caused by anyone else


if __name__ == "__main__":
    print("READY", os.getpid(), flush=True)
    busy_loop(sys.argv[1] if len(sys.argv) > 1 else "")
