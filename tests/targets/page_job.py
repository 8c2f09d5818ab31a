"""A 4-rank gloo training job for ``probe ... page``: every rank trains a small model for ``PAGE_STEPS``
steps (forward, backward, an all_reduce of the loss, an optimizer step, ``STEP_SLEEP`` s more on rank 1),
then rank ``HANG_RANK`` waits in its data loader (``load_next_batch``) and skips the next all_reduce,
which the others wait in. Each rank prints ``READY <pid> <rank>`` before that last step."""

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

HANG_RANK = int(os.environ.get("HANG_RANK", "2"))
STEPS = int(os.environ.get("PAGE_STEPS", "12"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: torch.Tensor) -> None:
    loss = model(data).pow(2).mean()
    loss.backward()
    dist.all_reduce(loss.detach())  # the others wait here for the rank that never comes
    optimizer.step()
    optimizer.zero_grad()


def load_next_batch() -> None:
    threading.Event().wait(600)  # the odd one out: stuck in its data loader, it skipped the collective


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    for _ in range(STEPS):
        train_step(model, optimizer, data)
        time.sleep(STEP_SLEEP * (3 if rank == 1 else 1))
    sys.stdout.write("READY %d %d\n" % (os.getpid(), rank))
    sys.stdout.flush()
    if rank == HANG_RANK:
        load_next_batch()
    else:
        train_step(model, optimizer, data)


main()
