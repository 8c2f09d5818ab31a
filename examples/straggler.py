"""A 4-rank CPU job (gloo) in which rank 1 is a straggler: its step sleeps 50 ms inside a module.

    PROBE_PORT=9700 PROBE_TORCH_TRACE=1 torchrun --nproc-per-node 4 examples/straggler.py &
    probe 127.0.0.1:9700 --all-ranks query \\
        "SELECT sum(duration) AS compute FROM python.torch_trace
         WHERE step > (SELECT max(step) - 5 FROM python.torch_trace) AND stage = 'forward'" \\
        --merge "SELECT rank, compute FROM result ORDER BY compute DESC LIMIT 1"

The trap: every rank waits for the slowest in all_reduce, so the straggler is the rank that waits
*least* there; ranking by time in collectives (or by step time) names its victims. Rank by each rank's
own compute instead: the self time of its traced modules, which excludes the waits.
"""

import os
import time

import torch
import torch.distributed as dist

STRAGGLER = int(os.environ.get("STRAGGLER_RANK", "1"))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.get_rank() == STRAGGLER:
            time.sleep(0.05)  # the straggler: slow compute in its own step
        return torch.relu(self.linear(x))


def main() -> None:
    dist.init_process_group("gloo")
    model = torch.nn.Sequential(Block(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(int(os.environ.get("STEPS", "100000"))):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for p in model.parameters():  # gradient averaging: everyone waits for the slowest rank here
            dist.all_reduce(p.grad)
        optimizer.step()
        if step == 10:
            print("READY %d %d" % (os.getpid(), dist.get_rank()), flush=True)


main()
