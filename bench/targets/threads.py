"""A benchmark target: N threads, each ~DEPTH frames deep in Python recursion, then blocked.

    python bench/targets/threads.py [--threads 65] [--depth 30] [--main block|spin|gap]

``--threads`` counts every thread, the main one included. The main thread recurses too and then:

* ``block``: sleeps (``time.sleep``), like the workers are blocked (they wait on an ``Event``);
* ``spin``: runs a tight pure-Python loop forever;
* ``gap``: runs a tight pure-Python loop that records the longest gap between two iterations
  (``time.perf_counter``). One of the threads (also DEPTH deep) reads stdin: on each line, the main
  loop prints ``GAP <ms>``, the longest gap since the previous line, and starts a new window. The
  iteration in which the request is seen is left out, so the reader's own wake-up is not counted.

Prints ``READY <pid>`` once every thread is in place. Dies with its parent (PR_SET_PDEATHSIG).
"""

import argparse
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable, List

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when the process that started us goes away."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)


def deep(n: int, then: Callable[[], None]) -> None:
    """Recurse ``n`` Python frames, then call ``then``."""
    if n > 0:
        return deep(n - 1, then)
    then()


def worker_bottom(ready: threading.Semaphore, never: threading.Event) -> Callable[[], None]:
    def bottom() -> None:
        ready.release()
        never.wait()
    return bottom


def reader_bottom(ready: threading.Semaphore, requests: List[int]) -> Callable[[], None]:
    def bottom() -> None:
        ready.release()
        for _ in sys.stdin:
            requests.append(1)
    return bottom


def block() -> None:
    print("READY %d" % os.getpid(), flush=True)
    while True:
        time.sleep(3600)


def spin() -> None:
    print("READY %d" % os.getpid(), flush=True)
    x = 0
    while True:
        x += 1


def gap_loop(requests: List[int]) -> Callable[[], None]:
    def loop() -> None:
        clock = time.perf_counter
        print("READY %d" % os.getpid(), flush=True)
        worst = 0.0
        last = clock()
        while True:
            now = clock()
            if requests:
                requests.clear()
                sys.stdout.write("GAP %.3f\n" % (worst * 1000.0))
                sys.stdout.flush()
                worst = 0.0
                now = clock()
            elif now - last > worst:
                worst = now - last
            last = now
    return loop


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=65)
    parser.add_argument("--depth", type=int, default=30)
    parser.add_argument("--main", choices=("block", "spin", "gap"), default="block")
    args = parser.parse_args()
    die_with_parent()
    ready = threading.Semaphore(0)
    never = threading.Event()
    requests: List[int] = []
    others = args.threads - 1
    if args.main == "gap":
        others -= 1
        threading.Thread(target=deep, args=(args.depth, reader_bottom(ready, requests)), name="stdin-reader",
                         daemon=True).start()
    for i in range(others):
        threading.Thread(target=deep, args=(args.depth, worker_bottom(ready, never)), name="worker-%d" % i,
                         daemon=True).start()
    for _ in range(args.threads - 1):
        if not ready.acquire(timeout=60):
            sys.exit("threads did not start")
    then = {"block": block, "spin": spin, "gap": gap_loop(requests)}[args.main]
    deep(args.depth, then)


if __name__ == "__main__":
    main()
