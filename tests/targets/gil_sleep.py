"""A target whose main thread sleeps inside a C call that keeps the GIL (``sleep`` from libc through
``ctypes.PyDLL``, which does not release it): no Python code runs until the call returns.

``gil_sleep.py [SECONDS] [then-idle]`` (default 600); prints ``READY <pid>`` just before the call. With
``then-idle`` it runs Python again after the call (a loop of short sleeps) instead of exiting.
"""

import ctypes
import os
import sys
import time

seconds = int(sys.argv[1]) if len(sys.argv) > 1 else 600
print("READY", os.getpid(), flush=True)
ctypes.PyDLL(None).sleep(seconds)
while len(sys.argv) > 2 and sys.argv[2] == "then-idle":
    time.sleep(0.1)
