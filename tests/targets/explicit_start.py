"""A target that starts the agent itself (``probe.start()``), for interpreters without the .pth hook.

Runs on any CPython 3.9+: it needs only the standard library and the probe package on sys.path.
"""

import os
import sys
import threading
import time

import probe

probe.start()


def waiting_worker() -> None:
    threading.Event().wait()


threading.Thread(target=waiting_worker, name="worker-1", daemon=True).start()
print("READY", os.getpid(), "%d.%d" % sys.version_info[:2], flush=True)
while True:
    time.sleep(0.2)
