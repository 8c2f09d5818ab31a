"""A busy target whose GIL always moves: the main thread and three more count in pure Python, so every
thread waits for the GIL again and again, and the agent's accept thread with them. Nothing keeps the GIL
in C: a client must never call it blocked. Prints ``READY <pid>``."""

import os
import threading

counts = [0, 0, 0, 0]


def spin(slot: int) -> None:
    while True:
        counts[slot] += 1


for i in range(1, 4):
    threading.Thread(target=spin, args=(i,), name="spinner-%d" % i, daemon=True).start()
print("READY", os.getpid(), flush=True)
spin(0)
