"""A benchmark target shaped like py-spy's own test scripts: a loop of nested function calls.

    python bench/targets/nested.py [--threads 1] [--work sleep|spin]

Every thread (the main one included; ``--threads`` counts them all) runs ``while True: outer()``, where
``outer`` calls ``middle`` calls ``inner``, which sleeps 10 ms (``sleep``: the GIL mostly free, as in
py-spy's ``longsleep.py``) or counts to 10,000 in Python (``spin``: the GIL always wanted). Prints
``READY <pid>`` once every thread runs. Dies with its parent (PR_SET_PDEATHSIG).
"""

import argparse
import ctypes
import os
import signal
import threading
import time


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the process that started us goes away."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)


def inner(work: str) -> int:
    if work == "sleep":
        time.sleep(0.01)
        return 0
    total = 0
    for i in range(10000):
        total += i
    return total


def middle(work: str) -> int:
    return inner(work) + 1


def outer(work: str) -> int:
    return middle(work) + 1


def loop(work: str, started: threading.Semaphore) -> None:
    started.release()
    while True:
        outer(work)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", choices=("sleep", "spin"), default="sleep")
    args = parser.parse_args()
    die_with_parent()
    started = threading.Semaphore(0)
    for i in range(args.threads - 1):
        threading.Thread(target=loop, args=(args.work, started), name="worker-%d" % i, daemon=True).start()
    for _ in range(args.threads - 1):
        started.acquire()
    print("READY %d" % os.getpid(), flush=True)
    loop(args.work, threading.Semaphore(0))


if __name__ == "__main__":
    main()
