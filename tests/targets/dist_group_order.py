"""A torchrun job whose ranks hang in collectives of two process groups (gloo, CPU). ``GROUP_HANG``:

* ``cycle`` (2 ranks): at step 5 rank 1 enters the first all_reduce of a subgroup of both ranks (unused
  till then), rank 0 the world's barrier: each waits for the other, neither is behind by itself;
* ``root`` (3 ranks): at step 5 rank 2 sleeps outside any collective, rank 1 enters an all_reduce of the
  subgroup {1, 2}, rank 0 the world's barrier: rank 2 is the one the others wait for.

Every rank prints ``READY pid rank local_rank`` once it reached its hang (rank 2 of ``root`` before it sleeps)."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
mode = os.environ["GROUP_HANG"]
sub = dist.new_group([0, 1] if mode == "cycle" else [1, 2])
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


def ready() -> None:
    sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
    sys.stdout.flush()


def world_step(t: torch.Tensor) -> None:
    dist.all_reduce(t)


def subgroup_step(t: torch.Tensor) -> None:
    dist.all_reduce(t, group=sub)


def wait_for_everyone() -> None:
    dist.barrier()


def load_slowly() -> None:
    ready()
    while True:
        time.sleep(0.5)


for step in range(10 ** 6):
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    t = torch.ones(1)
    if step == 5:
        if mode == "root" and rank == 2:
            load_slowly()
        ready()
        if rank == 1:
            subgroup_step(t)
        else:
            wait_for_everyone()
    world_step(t)
    if mode == "root" and rank in (1, 2):
        subgroup_step(t)
    time.sleep(0.02)
