"""Injection target: 50 threads (waiting on events, sleeping, and a few busy) besides the main thread."""

import os
import sys
import threading
import time


def waiter(event: threading.Event) -> None:
    event.wait()


def sleeper() -> None:
    while True:
        time.sleep(0.05)


def spinner() -> None:
    while True:
        for _ in range(1000):
            pass


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    never = threading.Event()
    for i in range(count):
        target = (waiter, sleeper, spinner)[0 if i % 10 < 6 else (1 if i % 10 < 9 else 2)]
        args = (never,) if target is waiter else ()
        threading.Thread(target=target, args=args, name="worker-%d" % i, daemon=True).start()
    print("READY", os.getpid(), flush=True)
    while True:
        time.sleep(0.05)
