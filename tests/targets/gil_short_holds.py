"""A busy target whose main thread keeps the GIL in C calls of 0.12 s, one after another, with a
moment of Python between them (numeric code, pickling, a regex: calls that hold the GIL and return).
The agent runs between the calls: a client must wait for it, never call the GIL held for good.
``argv[1]``: the seconds of each call (0.12)."""

import ctypes
import os
import sys

libc = ctypes.PyDLL(None)
count = 0
micros = int(float(sys.argv[1]) * 1e6) if len(sys.argv) > 1 else 120000
print("READY", os.getpid(), flush=True)
while True:
    libc.usleep(micros)  # keeps the GIL (PyDLL)
    count += 1
