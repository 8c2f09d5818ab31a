"""A rank started by srun (no torch): its rank from Slurm's SLURM_PROCID and SLURM_LOCALID. The rank named
by ``GIL_RANK`` holds the GIL in a C call (libc sleep through ctypes.PyDLL), the one named by ``HANG_RANK``
waits in ``stuck_in_all_reduce``, the others in ``wait_for_work``. Every rank prints
``READY <pid> <rank> <local_rank>`` first, in one write."""

import ctypes
import os
import sys
import threading


def hold_the_gil() -> None:
    ctypes.PyDLL(None).sleep(600)


def stuck_in_all_reduce() -> None:
    threading.Event().wait(600)


def wait_for_work() -> None:
    threading.Event().wait(600)


rank = os.environ.get("SLURM_PROCID")
sys.stdout.write("READY %d %s %s\n" % (os.getpid(), rank, os.environ.get("SLURM_LOCALID")))
sys.stdout.flush()
if rank == os.environ.get("GIL_RANK"):
    hold_the_gil()
elif rank == os.environ.get("HANG_RANK"):
    stuck_in_all_reduce()
else:
    wait_for_work()
