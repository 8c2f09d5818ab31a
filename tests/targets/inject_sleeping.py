"""Injection target: the main thread sleeps in short time.sleep calls (the common idle state)."""

import os
import time


def idle_loop() -> None:
    while True:
        time.sleep(0.05)


if __name__ == "__main__":
    print("READY", os.getpid(), flush=True)
    idle_loop()
