"""A 2-rank gloo job whose rank ``SLOW_RANK`` reads its records slowly (``read_records`` sleeps ``READ_S``,
default 0.2 s, where the others take ~1 ms), for ``probe diagnose``'s straggler verdict: each step ends in an
``all_reduce`` of the gradients, issued from Python, where the fast ranks wait. A plain Adam loop with a
``for`` over a generator of batches. Prints ``READY <pid> <rank> <local_rank>`` at step 3.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

SLOW_RANK = int(os.environ.get("SLOW_RANK", "-1"))
READ_S = float(os.environ.get("READ_S", "0.2"))


def read_records(rank: int, n: int):
    time.sleep(READ_S if rank == SLOW_RANK else 0.001)
    g = torch.Generator().manual_seed(n)
    return torch.randn(32, 8, generator=g)


def batches(rank: int):
    n = 0
    while True:
        yield read_records(rank, n)
        n += 1


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    weights = torch.nn.Linear(8, 8)
    adam = torch.optim.Adam(weights.parameters(), lr=1e-2)
    for step, x in enumerate(batches(rank)):
        adam.zero_grad()
        (weights(x) - x).square().mean().backward()
        for p in weights.parameters():
            dist.all_reduce(p.grad)
        adam.step()
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()


main()
