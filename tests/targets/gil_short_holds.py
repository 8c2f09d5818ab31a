"""A busy target whose main thread keeps the GIL in C calls of 0.12 s, one after another, with a
moment of Python between them (numeric code, pickling, a regex: calls that hold the GIL and return).
The agent runs between the calls: a client must wait for it, never call the GIL held for good."""

import ctypes
import os

libc = ctypes.PyDLL(None)
count = 0
print("READY", os.getpid(), flush=True)
while True:
    libc.usleep(120000)  # keeps the GIL (PyDLL)
    count += 1
