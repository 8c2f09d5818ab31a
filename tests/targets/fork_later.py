"""A target that forks from its main thread when a file appears; the child exits normally (sys.exit).

The parent keeps the child's exit code in ``child_exit`` (read it with eval).
"""

import os
import sys
import time

go = sys.argv[1]
child_exit = None

print("READY", os.getpid(), flush=True)
while not os.path.exists(go):
    time.sleep(0.02)
child = os.fork()
if child == 0:
    sys.exit(0)  # a normal exit: atexit hooks, then the interpreter's whole finalization
_, status = os.waitpid(child, 0)
child_exit = os.waitstatus_to_exitcode(status)
while True:
    time.sleep(0.2)
