"""A target of the standard library alone, for interpreters that cannot import probe (Debian's
/usr/bin/python3, run with no probe installed for it): a named thread waits in a method, the main thread
sleeps in a nested function; ``READY <pid>`` once both are there. The lines marked ``# line:`` are asserted
by tests (found by their marks)."""

import os
import threading
import time


class Loader:
    def wait_for_batch(self, arrived: threading.Event, ready: threading.Event) -> None:
        ready.set()
        arrived.wait()  # line: loader waits


def outer() -> None:
    def inner_sleep() -> None:
        print("READY", os.getpid(), flush=True)
        while True:
            time.sleep(0.2)  # line: main sleeps

    inner_sleep()  # line: outer calls


started = threading.Event()
threading.Thread(target=Loader().wait_for_batch, args=(threading.Event(), started), name="loader-static",
                 daemon=True).start()
started.wait()
outer()  # line: module calls
