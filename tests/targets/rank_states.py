"""A rank of a job (no torch needed) in the state the test asks for by rank: ``GIL_RANK`` holds the GIL in
a C call (libc sleep through ctypes.PyDLL), the others wait in an Event. The rank and local rank come from
whichever launcher's variables are set (torchrun's, Slurm's, Open MPI's). Every rank prints
``READY <pid> <rank> <local_rank>`` first, in one write."""

import ctypes
import os
import sys
import threading


def hold_the_gil() -> None:
    ctypes.PyDLL(None).sleep(600)


def wait_for_work() -> None:
    threading.Event().wait(600)


def first(*names: str) -> "str | None":
    return next((os.environ[n] for n in names if n in os.environ), None)


rank = first("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK")
local_rank = first("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
sys.stdout.write("READY %d %s %s\n" % (os.getpid(), rank, local_rank))
sys.stdout.flush()
if rank == os.environ.get("GIL_RANK"):
    hold_the_gil()
else:
    wait_for_work()
