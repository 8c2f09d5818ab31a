"""A target that starts one child with multiprocessing's ``spawn`` start method and waits.

The child is a fresh interpreter that inherits the environment (``PROBE_LISTEN`` too), so its agent
finds the TCP port taken by this process. Prints ``CHILD <child pid>``, then ``READY <pid>``, once the child runs. The
child leaves when this process does (SIGTERM here runs the exit handlers, which end the child).
"""

import multiprocessing
import os
import signal
import sys
import time


def child(conn, parent: int) -> None:
    conn.send(os.getpid())
    conn.close()
    while os.getppid() == parent:
        time.sleep(0.1)


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child, args=(send, os.getpid()), name="spawned-child", daemon=True)
    proc.start()
    if not receive.poll(30):
        raise SystemExit("the spawned child did not start within 30 s")
    print("CHILD", receive.recv(), flush=True)
    print("READY", os.getpid(), flush=True)
    while True:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
