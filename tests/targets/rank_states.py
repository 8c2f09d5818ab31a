"""A rank of a torchrun job (no torch needed) in the state the test asks for by rank:
``GIL_RANK`` holds the GIL in a C call (libc sleep through ctypes.PyDLL), the others wait in an Event.
Every rank prints ``READY <pid> <rank> <local_rank>`` first, in one write."""

import ctypes
import os
import sys
import threading


def hold_the_gil() -> None:
    ctypes.PyDLL(None).sleep(600)


def wait_for_work() -> None:
    threading.Event().wait(600)


sys.stdout.write("READY %d %s %s\n" % (os.getpid(), os.environ.get("RANK"), os.environ.get("LOCAL_RANK")))
sys.stdout.flush()
if os.environ.get("RANK") == os.environ.get("GIL_RANK"):
    hold_the_gil()
else:
    wait_for_work()
