"""Work done as another local user, for the tests of what such a user gets (the security model: owner-only
sockets, pages and files). A forked child drops to the uid (and its gid, no supplementary groups), runs the
work and hands back the bytes it returns through a pipe; its exception comes back as text, never as the
parent's failure to read. Needs root, as every test here that uses it says in its skip mark.
"""

import os
import select
import signal
import time
import traceback
from typing import Callable

NOBODY = 65534


def run_as(uid: int, work: Callable[[], bytes], timeout: float = 60.0, limit: int = 1 << 24) -> bytes:
    """``work()``'s bytes (at most ``limit``), run by a forked child of user ``uid``; where it raised,
    ``b"child failed: "`` and the traceback's last line. A child still at work after ``timeout`` seconds is
    killed, and TimeoutError raised."""
    "x".encode("idna")  # codecs imported here: after the drop, the child may not read root's files
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(read)
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                out = work()[:limit]
            except BaseException:  # noqa: BLE001 -- said to the parent
                out = b"child failed: " + traceback.format_exc().strip().splitlines()[-1].encode("utf-8", "replace")
            view = memoryview(out)
            while view:
                view = view[os.write(write, view):]
        finally:
            os._exit(0)
    os.close(write)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read], [], [], left)[0]:
                os.kill(child, signal.SIGKILL)
                raise TimeoutError("the uid-%d child did not finish within %.0f s" % (uid, timeout))
            chunk = os.read(read, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read)
        os.waitpid(child, 0)
    return b"".join(chunks)
