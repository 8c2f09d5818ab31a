"""A thread that keeps an RLock while it waits for a reply that never comes, and the main thread that waits
for that RLock: thread ``refresher`` runs ``refresh``, inside ``with registry_lock:``, waiting on an Event
no one sets; the main thread waits at ``with registry_lock:`` in ``lookup``. Prints ``READY <pid>`` once
the refresher holds the lock."""

import os
import sys
import threading

registry_lock = threading.RLock()
held = threading.Event()
reply = threading.Event()


def refresh() -> None:
    with registry_lock:
        held.set()
        reply.wait()  # the reply never comes


def lookup() -> None:
    with registry_lock:
        pass


threading.Thread(target=refresh, name="refresher", daemon=True).start()
held.wait()
sys.stdout.write("READY %d\n" % os.getpid())
sys.stdout.flush()
lookup()
