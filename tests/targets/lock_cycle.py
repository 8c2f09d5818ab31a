"""Two threads in a lock cycle: ``transfer`` holds ``ledger_lock`` and waits for ``audit_lock``, ``audit``
holds ``audit_lock`` and waits for ``ledger_lock``; the main thread waits to join them. Prints
``READY <pid>`` once both wait."""

import os
import sys
import threading

ledger_lock = threading.Lock()
audit_lock = threading.Lock()
both = threading.Barrier(2)


def transfer() -> None:
    with ledger_lock:
        both.wait()
        with audit_lock:
            pass


def audit() -> None:
    with audit_lock:
        both.wait()
        with ledger_lock:
            pass


workers = [threading.Thread(target=transfer, name="transfer"), threading.Thread(target=audit, name="audit")]
for worker in workers:
    worker.start()
sys.stdout.write("READY %d\n" % os.getpid())
sys.stdout.flush()
for worker in workers:
    worker.join()
