"""A training job whose steps get slower and slower: one module's time grows every step.

The model reads from a memory bank of past features. The bank was meant to keep its newest 1024
rows, but the line that trims it is missing, so it grows by a batch every step and the module that
attends over it (``memory``) costs a little more each time. Nothing fails; the log's ms/step creeps up.

    PROBE=1 python examples/slow_step.py &               # prints READY <pid> after 10 steps
    probe $PID trace start                                # time every module's forward, from now on
    probe $PID query "SELECT module, stage, COUNT(*) AS count, AVG(duration) AS avg_time, SUM(duration) AS total_time
                      FROM python.torch_trace WHERE step > (SELECT MAX(step) - 5 FROM python.torch_trace)
                      GROUP BY module, stage ORDER BY total_time DESC LIMIT 10"
                                                          # -> `memory` first: it holds most of the step
    probe $PID query "SELECT step // 20 * 20 AS from_step, round(AVG(duration) * 1000, 2) AS ms
                      FROM python.torch_trace WHERE module = 'memory' GROUP BY 1 ORDER BY 1"
                                                          # -> its time grows, 20 steps after 20 steps
    probe $PID eval --frame MainThread:main "model.memory.bank.shape"   # -> larger at every look
    probe $PID trace stop

``duration`` is self time (a span minus its traced children), so the query ranks the module that is
slow itself, not ``Net``, which merely contains it. The job stops after 1000 steps.
"""

import os
import time

import torch
from torch import nn

STEPS = 1000


class MemoryBank(nn.Module):
    """Attends from each sample to the features of past batches, kept in ``bank``."""

    def __init__(self, dim: int, size: int = 1024) -> None:
        super().__init__()
        self.size = size
        self.register_buffer("bank", torch.zeros(0, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.bank):
            bank = self.bank
            weights = torch.softmax(x @ bank.T / bank.shape[1] ** 0.5, dim=1)
            x = x + weights @ bank
        self.bank = torch.cat([self.bank, x.detach()])  # the bug: [-self.size:] is missing
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(32, 128), nn.ReLU())
        self.memory = MemoryBank(128)
        self.head = nn.Linear(128, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.memory(self.embed(x)))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small job: leave the other cores alone
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    started = time.perf_counter()
    for step in range(STEPS):
        x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0:
            elapsed, started = time.perf_counter() - started, time.perf_counter()
            print("step %d loss %.3f %.1f ms/step" % (step, loss.item(), elapsed * 1000 / 50), flush=True)
        if step == 10:
            print("READY", os.getpid(), flush=True)


if __name__ == "__main__":
    main()
