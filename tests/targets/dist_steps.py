"""A gloo training job for ``probe diagnose`` by the step counter (no trace, no Flight Recorder).

Every rank trains a small model: forward, backward, an all_reduce of the loss, an optimizer step, and a
sleep of ``STEP_SLEEP`` s. Each rank prints ``READY <pid> <rank> <local_rank>`` once it has made 3 steps.
After each step a rank reads ``DIAG_CONTROL`` (a file; absent or empty: nothing to do), one order a line:

- ``solo 0``: from the next step on, for good, no rank calls the all_reduce (the ranks step on their own,
  not kept in step); the ranks agree on the step through the all_reduce itself, which carries the order;
- ``slow R``: rank R sleeps ``SLOW_S`` more every step;
- ``nap R``: rank R waits in ``between_steps`` (a sleep, outside any collective) while the order stands.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

CONTROL = os.environ.get("DIAG_CONTROL", "")
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0.02"))
SLOW_S = float(os.environ.get("SLOW_S", "0.15"))


def read_orders() -> dict:
    try:
        with open(CONTROL) as handle:
            lines = [line.split() for line in handle.read().splitlines()]
    except OSError:
        return {}
    return {words[0]: int(words[1]) for words in lines if len(words) == 2 and words[1].isdigit()}


def between_steps(rank: int) -> None:
    while read_orders().get("nap") == rank:
        time.sleep(0.2)


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    step = 0
    orders: dict = {}
    solo = False
    while True:
        loss = model(data).pow(2).mean()
        loss.backward()
        if not solo:
            both = torch.cat([loss.detach().reshape(1), torch.tensor([float("solo" in orders)])])
            dist.all_reduce(both)
            solo = bool(both[1].item() > 0)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        orders = read_orders()
        if orders.get("nap") == rank:
            between_steps(rank)
        time.sleep(STEP_SLEEP + (SLOW_S if orders.get("slow") == rank else 0.0))


main()
