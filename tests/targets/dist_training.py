"""A gloo training job whose training trouble the test plants on one rank while it runs, for ``probe diagnose``.

Every rank reads its batches from a DataLoader with ``num_workers=2`` (one batch a sample, ``batch_size=None``),
trains a small model (Linear 64->1024, ReLU, Linear 1024->1), all_reduces the gradients (as DDP does: a NaN on
one rank reaches the others' weights), steps its optimizer and sleeps ``STEP_SLEEP`` s. Each rank prints
``READY <pid> <rank> <local_rank>`` once it has made 3 steps. Each step the rank reads ``DIAG_CONTROL`` (a
file; absent or empty: nothing to do), one order a line, ``WHAT RANK``:

- ``leak R``: rank R keeps each step's loss with its autograd graph (about 1 MB a step) while the order stands;
  they are dropped when it goes (at most ``LEAK_CAP`` kept);
- ``hang R``: rank R's DataLoader worker 1 sleeps in ``__getitem__`` while the order stands;
- ``nan R``: rank R's next batch holds a NaN (once: the order is carried out one time).
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, get_worker_info

CONTROL = os.environ.get("DIAG_CONTROL", "")
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.03"))
LEAK_CAP = 400


def read_orders() -> dict:
    try:
        with open(CONTROL) as handle:
            lines = [line.split() for line in handle.read().splitlines()]
    except OSError:
        return {}
    return {words[0]: int(words[1]) for words in lines if len(words) == 2 and words[1].isdigit()}


class Batches(Dataset):
    """Sample i is batch i: 128 rows of 64 features and their targets."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __len__(self) -> int:
        return 10 ** 9

    def __getitem__(self, index: int):
        info = get_worker_info()
        while info is not None and info.id == 1 and read_orders().get("hang") == self.rank:
            time.sleep(0.2)  # the hung read: until the order goes
        generator = torch.Generator().manual_seed(index)
        return torch.randn(128, 64, generator=generator), torch.randn(128, 1, generator=generator)


def sync_grads(model: torch.nn.Module) -> None:
    for param in model.parameters():
        dist.all_reduce(param.grad)
        param.grad /= dist.get_world_size()


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    loader = DataLoader(Batches(rank), batch_size=None, num_workers=2, prefetch_factor=2)
    kept = []  # the leak: losses with their graphs
    poisoned = False
    step = 0
    for x, y in loader:
        orders = read_orders() if CONTROL else {}
        if orders.get("nan") == rank and not poisoned:
            x[5, 7] = float("nan")
            poisoned = True
        leaking = orders.get("leak") == rank
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=leaking)
        sync_grads(model)
        optimizer.step()
        if leaking and len(kept) < LEAK_CAP:
            kept.append(loss)
        elif not leaking:
            kept.clear()
        step += 1
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        time.sleep(STEP_SLEEP)


main()
