"""A 2-rank gloo regression job that can be made to diverge, for ``probe diagnose``'s NaN verdict without the
opt-in NaN/Inf check: every round each rank fits its own batch, averages the flattened gradients with one
``all_reduce`` and steps Adam. When ``DIVERGE_CONTROL`` (a file) holds ``blowup R``, rank R's loss is scaled by
infinity from then on: its gradients turn NaN, the all_reduce carries them to every rank, and every rank's
weights and loss are NaN while the rounds go on. Prints ``READY <pid> <rank> <local_rank>`` after round 4.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

CONTROL = os.environ.get("DIVERGE_CONTROL", "")


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(12, 48), torch.nn.GELU())
        self.out = torch.nn.Linear(48, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(self.trunk(features))


def told_to_blow_up(rank: int) -> bool:
    try:
        with open(CONTROL) as handle:
            return "blowup %d" % rank in handle.read()
    except OSError:
        return False


def average_gradients(net: torch.nn.Module) -> None:
    flat = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for p in net.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    net = Regressor()
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    rounds = 0
    while True:
        features = torch.randn(64, 12)
        target = features.sum(dim=1, keepdim=True)
        loss = torch.nn.functional.mse_loss(net(features), target)
        if told_to_blow_up(rank):
            loss = loss * float("inf")
        adam.zero_grad()
        loss.backward()
        average_gradients(net)
        adam.step()
        rounds += 1
        if rounds == 4:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        time.sleep(0.05)


main()
