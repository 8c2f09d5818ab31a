"""A small CPU training job for the torch trace tests: ``train_trace.py MODE [POISON_STEP]``.

MODE: ``normal``; ``slow`` (module ``encoder.2`` sleeps longer every step); ``leak`` (every loss is kept
with its graph, so memory grows each step); ``nan`` (the batch of step POISON_STEP, default 8, holds a
NaN). Prints ``READY <pid>`` before the first step, then trains until killed, a few ms between steps.
"""

import os
import sys
import time

import torch
from torch import nn

STEPS = [0]  # steps done, for tests that check that training goes on


class Slow(nn.Module):
    """Identity that sleeps ``delay`` seconds: the module whose time grows in mode ``slow``."""

    def __init__(self) -> None:
        super().__init__()
        self.delay = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(64, 256), nn.ReLU(inplace=True), Slow(), nn.Linear(256, 256),
                                     nn.ReLU(inplace=True))
        self.head = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "normal"
    poison = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    kept = []
    batch = 512 if mode == "leak" else 32
    print("READY", os.getpid(), flush=True)
    step = 0
    while True:
        x = torch.randn(batch, 64)
        y = torch.randint(0, 10, (batch,))
        if mode == "nan" and step == poison:
            x[3, 5] = float("nan")
        if mode == "slow":
            model.encoder[2].delay = min(0.0005 * step, 0.02)
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward(retain_graph=mode == "leak")
        optimizer.step()
        if mode == "leak":
            kept.append(loss)  # the graph, and every activation it holds, stays alive
        step += 1
        STEPS[0] = step
        time.sleep(0.005)


if __name__ == "__main__":
    main()
