"""A small training loop for the stall watch's tests: gloo ranks under torchrun, or one plain process.

Each step: a forward (``STEP_SLEEP`` seconds of sleep in it, default 0.02), a backward, an all_reduce of
the loss (where there is a process group), an optimizer step. ``PG_TIMEOUT_S`` (default 600) is the
process group's timeout. Every rank prints ``READY <pid> <rank> <local_rank>`` after 3 steps. Before each
step a rank reads ``SNAP_CONTROL`` (a file; absent: no order), one order a line:

- ``skip R``: rank R calls no collective any more and waits in ``load_next_batch`` (the others wait in
  their all_reduce until the process group's timeout ends them);
- ``eval``: every rank makes no optimizer step, but goes on calling all_reduce (as an evaluation with
  collectives does) while the order stands;
- ``exit``: every rank leaves the loop and exits normally;
- ``abort R``: rank R calls ``os.abort()`` (SIGABRT, as torch's watchdog aborts a rank);
- ``grow R``: rank R keeps 2 MiB more at each step while the order stands (1 GiB at most), as a leak does.
"""

import os
import sys
import threading
import time
from datetime import timedelta

import torch

CONTROL = os.environ.get("SNAP_CONTROL", "")
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
DISTRIBUTED = "WORLD_SIZE" in os.environ


def orders() -> list:
    try:
        with open(CONTROL) as handle:
            return [line.split() for line in handle.read().splitlines()]
    except OSError:
        return []


def load_next_batch(rank: int) -> None:
    while ["skip", str(rank)] in orders():
        threading.Event().wait(0.2)


def sync_loss(loss: torch.Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(loss)


def main() -> None:
    rank = 0
    if DISTRIBUTED:
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=float(os.environ.get("PG_TIMEOUT_S", "600"))))
        rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    step = 0
    leak = []
    while True:
        said = orders() if CONTROL else []
        if ["exit"] in said:
            break
        if ["skip", str(rank)] in said:
            load_next_batch(rank)
        if ["abort", str(rank)] in said:
            os.abort()
        if ["grow", str(rank)] in said and len(leak) < 512:
            leak.append(bytearray(b"\1") * (2 << 20))
        if ["eval"] in said:
            time.sleep(STEP_SLEEP)
            if DISTRIBUTED:
                sync_loss(torch.zeros(1))
            continue
        time.sleep(STEP_SLEEP)
        loss = model(data).pow(2).mean()
        loss.backward()
        if DISTRIBUTED:
            sync_loss(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
    if DISTRIBUTED:
        import torch.distributed as dist

        dist.destroy_process_group()


main()
