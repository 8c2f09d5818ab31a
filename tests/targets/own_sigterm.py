"""A target that handles SIGTERM itself: it says so on stdout and carries on."""

import os
import signal
import time


def on_term(signum, frame) -> None:
    print("TERM", flush=True)


signal.signal(signal.SIGTERM, on_term)
print("READY", os.getpid(), flush=True)
while True:
    time.sleep(0.2)
