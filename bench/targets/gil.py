"""A process whose main thread sits in a C call that keeps the GIL (libc sleep through ctypes.PyDLL),
with a few more threads; prints ``READY <pid>`` just before the call."""

import ctypes
import os
import threading


def worker() -> None:
    threading.Event().wait()


for i in range(4):
    threading.Thread(target=worker, name="worker-%d" % i, daemon=True).start()
print("READY", os.getpid(), flush=True)
ctypes.PyDLL(None).sleep(3600)
