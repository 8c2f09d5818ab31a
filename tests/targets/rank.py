"""A stand-in for one rank of a torchrun job: says who it is, then waits like a rank in a collective."""

import os
import threading

print("READY", os.getpid(), os.environ.get("RANK"), os.environ.get("LOCAL_RANK"), flush=True)
threading.Event().wait()
