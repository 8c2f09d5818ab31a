"""Injection target: the main thread is blocked in C with the GIL released and never wakes up.

``inject_blocked.py event|lock|sleep|queue``: ``threading.Event().wait()``, a lock acquired twice,
one long ``time.sleep``, or ``queue.Queue().get()``. Pending calls never run in these states.
"""

import os
import queue
import sys
import threading
import time


def block(mode: str) -> None:
    if mode == "event":
        threading.Event().wait()
    elif mode == "lock":
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()
    elif mode == "sleep":
        time.sleep(3600)
    elif mode == "queue":
        queue.Queue().get()
    else:
        raise SystemExit("unknown mode %r" % mode)


if __name__ == "__main__":
    print("READY", os.getpid(), flush=True)
    block(sys.argv[1] if len(sys.argv) > 1 else "event")
