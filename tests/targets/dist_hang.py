"""A 4-rank gloo job in which one rank skips a collective: it waits in its data loader while the others
block in all_reduce waiting for it. Every rank prints ``READY <pid> <rank>`` before the hanging step."""

import os
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

SKIP_RANK = int(os.environ.get("HANG_SKIP_RANK", "2"))


def train_step(t: torch.Tensor) -> None:
    dist.all_reduce(t)  # the others wait here for the rank that never comes


def load_next_batch() -> None:
    threading.Event().wait(600)  # the odd one out: stuck in its data loader, it skipped the collective


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    t = torch.ones(4)
    for _ in range(3):
        train_step(t)
    sys.stdout.write("READY %d %d\n" % (os.getpid(), rank))
    sys.stdout.flush()
    if rank == SKIP_RANK:
        load_next_batch()
    else:
        train_step(t)


main()
