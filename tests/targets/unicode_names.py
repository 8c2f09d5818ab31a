"""A target whose threads and functions have names of every width of str (Latin-1, UCS-2, UCS-4), with its main
thread renamed: what a reader of its memory must decode as py-spy does."""

import os
import threading
import time


def fünf() -> None:
    while True:
        time.sleep(0.05)


def 日本() -> None:
    while True:
        time.sleep(0.05)


threading.Thread(target=fünf, name="naïve", daemon=True).start()
threading.Thread(target=日本, name="スレッド😀", daemon=True).start()
threading.current_thread().name = "main-renamed"
print("READY", os.getpid(), flush=True)
while True:
    time.sleep(0.1)
