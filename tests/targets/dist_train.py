"""One rank of a 2-rank gloo job on the CPU: a few training steps, then it waits like a rank between steps.

    torchrun --nproc_per_node=2 dist_train.py [--fsdp]

``--fsdp``: the model is sharded with FSDP2's ``fully_shard`` (its parameters are DTensors). Without
it, three explicit all_reduces. Prints ``READY <pid> <rank> <local_rank>`` in one write.
"""

import os
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
if "--fsdp" in sys.argv:
    from torch.distributed.fsdp import fully_shard

    fully_shard(model)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
for _ in range(3):
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
if "--fsdp" not in sys.argv:
    total = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(total)
dist.barrier()
sys.stdout.write("READY %d %s %s\n" % (os.getpid(), os.environ.get("RANK"), os.environ.get("LOCAL_RANK")))
sys.stdout.flush()
threading.Event().wait()
