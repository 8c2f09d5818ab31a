"""Injection target: a process that already runs an agent, started by the program itself."""

import os
import time

import probe

if __name__ == "__main__":
    probe.start()
    print("READY", os.getpid(), flush=True)
    while True:
        time.sleep(0.05)
