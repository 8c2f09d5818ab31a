"""A stand-in for one rank of a torchrun job: says who it is, then waits like a rank in a collective."""

import os
import sys
import threading

# One write: torchrun runs ranks with -u, where print() writes each piece on its own and two ranks'
# lines interleave ("READYREADY 7331 1 1").
sys.stdout.write("READY %d %s %s\n" % (os.getpid(), os.environ.get("RANK"), os.environ.get("LOCAL_RANK")))
sys.stdout.flush()
threading.Event().wait()
