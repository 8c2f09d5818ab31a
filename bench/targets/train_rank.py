"""A benchmark target: one rank of a torchrun gloo job whose main loop trains a small MLP (forward,
backward, an all_reduce of the gradients, an optimizer step), as a data-parallel rank does.

    torchrun --nproc-per-node 2 bench/targets/train_rank.py [--width 256]

Prints ``READY <pid> <rank> <local_rank>`` once the process group is up, then once a second
``STAT <rank> <wall time> <steps> <longest step s> <median step s> <VmRSS kB>`` over the steps of that
second: the bench reads the rank's pause and memory from these lines and never asks the rank itself.
A step waits for the slower rank in its all_reduce, so a pause on either rank shows on both.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn


def vmrss_kb() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(64, args.width)
    world = dist.get_world_size()
    dist.barrier()
    sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
    sys.stdout.flush()
    steps: list = []
    window = time.time()
    while True:
        start = time.perf_counter()
        loss = model(batch).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optimizer.step()
        optimizer.zero_grad()
        steps.append(time.perf_counter() - start)
        now = time.time()
        if now - window >= 1.0:
            sys.stdout.write("STAT %d %.3f %d %.6f %.6f %d\n" % (rank, now, len(steps), max(steps),
                                                                 statistics.median(steps), vmrss_kb()))
            sys.stdout.flush()
            steps, window = [], now


if __name__ == "__main__":
    main()
