"""A 2-rank DDP job on the CPU (gloo) that keeps training under a StepLR schedule, a step every ~50 ms.

    torchrun --nproc_per_node=2 ddp_schedule.py

Prints ``READY <pid> <rank> <local_rank>`` once its first steps are done; trains until killed.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
torch.manual_seed(1)
net = DistributedDataParallel(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)))
sgd = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
decay = torch.optim.lr_scheduler.StepLR(sgd, step_size=1000, gamma=0.5)


def one_step(batch: torch.Tensor) -> None:
    sgd.zero_grad()
    net(batch).pow(2).mean().backward()
    sgd.step()
    decay.step()


for warmup in range(3):
    one_step(torch.randn(8, 6))
sys.stdout.write("READY %d %s %s\n" % (os.getpid(), os.environ.get("RANK"), os.environ.get("LOCAL_RANK")))
sys.stdout.flush()
while True:
    one_step(torch.randn(8, 6))
    time.sleep(0.05)
