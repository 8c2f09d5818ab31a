"""A target whose main thread sleeps, with two named worker threads in known functions."""

import os
import threading
import time

stop = threading.Event()
counter = {"n": 0}


def data_loader_wait() -> None:
    stop.wait()  # line asserted by tests: a thread blocked in Event.wait


def heartbeat() -> None:
    while not stop.is_set():
        counter["n"] += 1
        time.sleep(0.05)


threading.Thread(target=data_loader_wait, name="loader-0", daemon=True).start()
threading.Thread(target=heartbeat, name="heartbeat", daemon=True).start()


def main_sleep() -> None:
    print("READY", os.getpid(), flush=True)
    while True:
        time.sleep(0.2)


main_sleep()
