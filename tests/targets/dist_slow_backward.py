"""A 2-rank gloo job under DistributedDataParallel whose rank ``SLOW_RANK`` is slow inside its own backward
pass, for ``probe diagnose``'s straggler verdict. Its model holds a gradient-noise layer (an autograd
Function) whose backward, on that rank only, audits each gradient row in Python (``audit_rows``, ~0.3 s
a step); or, with ``SLOW_HOW=hook``, a full backward hook on its head module does that. DDP's gradient
all_reduce, inside every rank's backward, makes every step as long as the slow rank's: the other ranks
wait in their backward pass (in C). The batches come ready-made from a list. Prints
``READY <pid> <rank> <local_rank>`` after step 4.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

SLOW_RANK = int(os.environ.get("SLOW_RANK", "1"))
HOW = os.environ.get("SLOW_HOW", "function")


def audit_rows(grad: torch.Tensor) -> None:
    """Look at every row of a gradient, one at a time (slow on purpose: ~0.3 s)."""
    until = time.monotonic() + 0.3
    while time.monotonic() < until:
        for row in grad[:4]:
            float(row.abs().max())
        time.sleep(0.003)


class GradientNoise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features):  # type: ignore[no-untyped-def]
        return features.view_as(features)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        if dist.get_rank() == SLOW_RANK and HOW == "function":
            audit_rows(grad)
        return grad + 1e-6 * torch.randn_like(grad)


class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 48), nn.ReLU())
        self.head = nn.Linear(48, 2)

    def forward(self, features):  # type: ignore[no-untyped-def]
        return self.head(GradientNoise.apply(self.body(features)))


def on_head_grad(module, grad_input, grad_output):  # type: ignore[no-untyped-def]
    audit_rows(grad_output[0])


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(5)
    torch.set_num_threads(1)
    tower = Tower()
    if rank == SLOW_RANK and HOW == "hook":
        tower.head.register_full_backward_hook(on_head_grad)
    replicated = DistributedDataParallel(tower)
    adam = torch.optim.Adam(replicated.parameters(), lr=1e-3)
    batches = [(torch.randn(24, 12), torch.randint(0, 2, (24,))) for _ in range(16)]
    step = 0
    while True:
        features, labels = batches[step % len(batches)]
        adam.zero_grad()
        nn.functional.cross_entropy(replicated(features), labels).backward()
        adam.step()
        step += 1
        if step == 4:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        time.sleep(0.03)


if __name__ == "__main__":
    main()
