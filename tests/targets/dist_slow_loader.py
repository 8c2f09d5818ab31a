"""A 2-rank gloo job under DistributedDataParallel whose batches each rank makes itself, for ``probe diagnose``'s
straggler verdict: when ``LOADER_CONTROL`` (a file) holds ``slow R``, rank R's ``fetch_examples`` takes
``SLOW_S`` (default 0.25 s, busy in Python and a little sleep) where the others take a few ms; DDP's all_reduce
in every backward makes every rank's step as long as rank R's, the others waiting in it. Prints
``READY <pid> <rank> <local_rank>`` after step 3.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

CONTROL = os.environ.get("LOADER_CONTROL", "")
SLOW_S = float(os.environ.get("SLOW_S", "0.25"))


def slow_here(rank: int) -> bool:
    try:
        with open(CONTROL) as handle:
            return "slow %d" % rank in handle.read()
    except OSError:
        return False


def fetch_examples(rank: int, index: int):
    """The rank's own loading: decode a few records (a loop of small tensor ops)."""
    until = time.monotonic() + (SLOW_S if slow_here(rank) else 0.005)
    rows = []
    while time.monotonic() < until or not rows:
        rows.append(torch.full((20,), float(index % 7)) + torch.randn(20) * 0.1)
        if len(rows) > 64:
            rows = rows[-64:]
            time.sleep(0.002)
    batch = torch.stack(rows[-16:])
    return batch, batch.mean(dim=1, keepdim=True)


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(3)
    torch.set_num_threads(1)
    core = torch.nn.Sequential(torch.nn.Linear(20, 96), torch.nn.SiLU(), torch.nn.Linear(96, 1))
    model = DistributedDataParallel(core)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    index = 0
    while True:
        inputs, labels = fetch_examples(rank, index)
        sgd.zero_grad()
        torch.nn.functional.l1_loss(model(inputs), labels).backward()
        sgd.step()
        index += 1
        if index == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        time.sleep(0.06)


main()
