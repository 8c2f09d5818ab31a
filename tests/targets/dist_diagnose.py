"""A gloo training job whose trouble the test plants while it runs, for ``probe diagnose``.

Every rank trains a small model: a forward through ``Net`` (whose ``Block`` sleeps ``STEP_SLEEP`` seconds,
so a step is not all CPU on a loaded machine), a backward, an all_reduce of the loss and an optimizer step.
Each rank prints ``READY <pid> <rank> <local_rank>`` once it has made 3 steps. Before each step a rank
reads ``DIAG_CONTROL`` (a file; absent or empty: nothing to do) for orders, one a line, ``WHAT RANK``:

- ``straggle R``: rank R sleeps ``STRAGGLE_S`` more inside ``Block.forward`` every step;
- ``gil R``: rank R calls libc's sleep through ctypes.PyDLL (a C call that keeps the GIL) for 600 s;
- ``dumpgil R``: rank R first writes its Flight Recorder's dump where torch would
  (``$TORCH_FR_DUMP_TEMP_FILE<rank>``, as NCCL's watchdog does on a timeout), then does as ``gil R``;
- ``skip R``: rank R calls no collective and waits in ``load_next_batch`` while the order stands;
- ``slow 0``: every rank's step takes ``SLOW_S`` (a merely slow job).
"""

import ctypes
import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

CONTROL = os.environ.get("DIAG_CONTROL", "")
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
STRAGGLE_S = float(os.environ.get("STRAGGLE_S", "0.15"))
SLOW_S = float(os.environ.get("SLOW_S", "2.5"))
orders = {"straggle": -1, "slow": 0}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SLOW_S if orders["slow"] else
                   STEP_SLEEP + (STRAGGLE_S if orders["straggle"] == dist.get_rank() else 0.0))
        return torch.relu(self.linear(x))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def read_orders(rank: int) -> str:
    """The order for this rank in the control file ('' for none); sets the straggler for every rank."""
    try:
        with open(CONTROL) as handle:
            lines = [line.split() for line in handle.read().splitlines()]
    except OSError:
        return ""
    mine = ""
    orders["straggle"], orders["slow"] = -1, 0
    for words in lines:
        if len(words) == 2 and words[1].isdigit():
            if words[0] == "straggle":
                orders["straggle"] = int(words[1])
            elif words[0] == "slow":
                orders["slow"] = 1
            elif int(words[1]) == rank:
                mine = words[0]
    return mine


def hold_the_gil() -> None:
    ctypes.PyDLL(None).sleep(600)


def load_next_batch(rank: int) -> None:
    while read_orders(rank) == "skip":
        threading.Event().wait(0.2)


def sync_loss(loss: torch.Tensor) -> None:
    dist.all_reduce(loss)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    step = 0
    while True:
        order = read_orders(rank) if CONTROL else ""
        if order == "dumpgil":
            with open(os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank), "wb") as handle:
                handle.write(torch._C._distributed_c10d._dump_fr_trace())
        if order in ("gil", "dumpgil"):
            hold_the_gil()
        elif order == "skip":
            load_next_batch(rank)
        loss = model(data).pow(2).mean()
        loss.backward()
        sync_loss(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()


main()
