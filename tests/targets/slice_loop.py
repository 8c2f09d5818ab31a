"""A main loop that rewrites a large list in one C-level slice assignment per step.

Every element of ``data`` holds the same step number at any bytecode boundary of the main thread; a
reader that goes element by element while the loop runs on may see two steps.
"""

import os

N = 200_000
data = [0] * N
step = 0


def main() -> None:
    global step
    print("READY", os.getpid(), flush=True)
    while True:
        step += 1
        fresh = [step] * N
        data[:] = fresh  # one bytecode: the whole list changes at once


main()
