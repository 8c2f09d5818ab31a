"""A 2-rank gloo job that takes its batches from a DataLoader (no workers), for the step extras: each batch
costs the loader ``FETCH_S`` (default 0.01 s, a sleep in the dataset); then forward, backward, an all_reduce
of the gradients by hand, an SGD step at lr ``LR`` (default 0.0125, a plain float) and a sleep of
``STEP_SLEEP`` s. Prints ``READY <pid> <rank> <local_rank>`` after step 3; runs until killed.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

FETCH_S = float(os.environ.get("FETCH_S", "0.01"))
LR = float(os.environ.get("LR", "0.0125"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))


class Slow(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10 ** 6

    def __getitem__(self, index: int):
        time.sleep(FETCH_S / 4)
        return torch.full((8,), float(index % 5))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(Slow(), batch_size=4)
    step = 0
    for batch in loader:
        model(batch).pow(2).mean().backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        time.sleep(STEP_SLEEP)


main()
