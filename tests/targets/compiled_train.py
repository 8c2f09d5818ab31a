"""A small torch.compile'd CPU training job for the trace tests: ``compiled_train.py [BACKEND]``.

Trains ``torch.compile(Net())`` (BACKEND: ``aot_eager`` by default: Dynamo and AOT autograd as with
inductor, the graphs run by eager torch; about 2 s of compile on a quiet CPU, inductor's 4-15 s) with SGD.
The first step compiles; then it prints ``READY <pid>`` and trains until killed, 20 ms between steps.
``STEPS[0]`` counts steps; ``dynamo_counts()`` says what Dynamo has done so far (its own counters).
"""

import os
import sys
import time

import torch
from torch import nn

STEPS = [0]
BACKEND = sys.argv[1] if len(sys.argv) > 1 else "aot_eager"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def dynamo_counts() -> dict:
    """Graph breaks, compiled graphs and compiled versions of ``Net.forward`` (1 = never recompiled)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    return {"graph_breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
            "forward_versions": len(_debug_get_cache_entry_list(Net.forward.__code__)),
            "compile_seconds": COMPILE_SECONDS[0]}


COMPILE_SECONDS = [0.0]


def step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module) -> None:
    x = torch.randn(16, 32)
    y = torch.randint(0, 10, (16,))
    loss = loss_fn(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    STEPS[0] += 1


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = Net()
    model = torch.compile(net, backend=BACKEND)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    step(model, optimizer, loss_fn)
    COMPILE_SECONDS[0] = round(time.perf_counter() - start, 2)
    print("READY", os.getpid(), flush=True)
    while True:
        step(model, optimizer, loss_fn)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
