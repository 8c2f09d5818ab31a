"""A quiet target whose main thread reaches a bytecode boundary every few milliseconds (a snippet placed
on it with ``eval --on main`` runs at once) and otherwise sleeps. Prints ``READY <pid>``."""

import os
import time

print("READY", os.getpid(), flush=True)
while True:
    time.sleep(0.005)
