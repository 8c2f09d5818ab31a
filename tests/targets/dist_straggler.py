"""A 2-rank gloo job whose ranks meet in an all_reduce at every step, for the persistent-straggler alert:
each step takes a batch from a DataLoader (``Records``, no workers), passes it through ``augment``, a
forward and backward, an all_reduce of the loss and an optimizer step, then sleeps ``STEP_SLEEP`` (0.02 s).
Before each step a rank reads ``STRAGGLER_CONTROL`` (a file; absent or empty: every rank quick), one order
a line:

- ``slow R loader``: rank R's ``Records.__getitem__`` sleeps, ``SLOW_S`` (0.3 s) a batch in all;
- ``slow R helper``: rank R's ``augment`` sleeps ``SLOW_S`` a step;
- ``exit``: every rank leaves the loop.

The other rank waits in its all_reduce meanwhile. Prints ``READY <pid> <rank> <local_rank>`` after step 3.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

CONTROL = os.environ.get("STRAGGLER_CONTROL", "")
SLOW_S = float(os.environ.get("SLOW_S", "0.3"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
BATCH = 8
ORDERS = {"now": []}  # read once a step


def read_orders() -> list:
    try:
        with open(CONTROL) as handle:
            return [line.split() for line in handle.read().splitlines()]
    except OSError:
        return []


def slow(rank: int, where: str) -> bool:
    return ["slow", str(rank), where] in ORDERS["now"]


class Records(torch.utils.data.Dataset):
    """Examples made on demand; a slow rank's take ``SLOW_S / BATCH`` each (a slow disk, a slow decoder)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, index: int):
        if slow(self.rank, "loader"):
            time.sleep(SLOW_S / BATCH)
        x = torch.full((16,), float(index % 5))
        return x, x.sum().reshape(1) / 16.0


def augment(batch: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank's own preprocessing of a batch."""
    if slow(rank, "helper"):
        time.sleep(SLOW_S)
    return batch * 1.01


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    batches = iter(torch.utils.data.DataLoader(Records(rank), batch_size=BATCH, num_workers=0))
    step = 0
    while True:
        ORDERS["now"] = read_orders() if CONTROL else []
        if ["exit"] in ORDERS["now"]:
            break
        inputs, labels = next(batches)
        inputs = augment(inputs, rank)
        sgd.zero_grad()
        loss = torch.nn.functional.mse_loss(model(inputs), labels)
        loss.backward()
        dist.all_reduce(loss.detach())
        sgd.step()
        step += 1
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        time.sleep(STEP_SLEEP)
    dist.destroy_process_group()


main()
