"""Two gloo ranks, each step an async all_reduce waited on in the program's own ``wait_for_grads``
(``work.wait()``: no torch.distributed frame stays on the stack while it waits). After 3 steps rank 1 calls
libc's sleep through ctypes.PyDLL in ``stall_in_c`` (a C call that keeps the GIL for 600 s): rank 0 then
waits in ``wait_for_grads`` for a rank that cannot answer. Each rank prints ``READY <pid> <rank>
<local_rank>`` when it reaches that state (rank 1 just before its C call)."""

import ctypes
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def stall_in_c() -> None:
    ctypes.PyDLL(None).sleep(600)


def wait_for_grads(work) -> None:  # type: ignore[no-untyped-def]
    work.wait()


def ready(rank: int) -> None:
    sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
    sys.stdout.flush()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    grads = torch.ones(4)
    for step in range(1000000):
        if step == 3 and rank == 1:
            ready(rank)
            stall_in_c()
        work = dist.all_reduce(grads, async_op=True)
        if step == 3:
            ready(rank)
        wait_for_grads(work)


main()
