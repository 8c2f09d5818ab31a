"""A training job whose memory grows every step: a list keeps losses together with their graphs.

Every step the script also scores a held-out batch for its progress log, but outside
``torch.no_grad()``, and keeps the loss tensor, not ``loss.item()``. A tensor that requires grad keeps
its graph, and the graph keeps the activations it saved for a backward that never comes: about half a
megabyte per step here, gigabytes in a real job, until the OOM killer ends it.

    PROBE=1 python examples/memory_growth.py &           # prints READY <pid> after 10 steps
    probe $PID trace start                                # records the process's RSS at every module
    probe $PID query "SELECT step, MAX(allocated) AS peak_memory, MAX(allocated) - MIN(allocated) AS memory_range
                      FROM python.torch_trace WHERE step > (SELECT MAX(step) - 20 FROM python.torch_trace)
                      GROUP BY step ORDER BY step"        # -> peak_memory (MB) higher at every step
    probe $PID query "SELECT name, type, value FROM python.locals
                      WHERE thread_name = 'MainThread' AND func = 'main' AND type = 'list'"
                                                          # -> val_history: a list of tensors with grad_fn
    probe $PID eval --frame MainThread:main "len(val_history), val_history[-1].grad_fn"
                                                          # -> (N, <NllLossBackward0 ...>): each holds a graph
    probe $PID query "SELECT shape, count(*) AS n, sum(bytes) AS bytes FROM torch.tensors
                      WHERE kind = 'tensor' GROUP BY ALL ORDER BY bytes DESC LIMIT 3"
                                                          # -> [128, 512] activations, two more every step

On a CPU-only job ``allocated`` is the process's RSS (on CUDA, the caching allocator's count), the agent's
own memory included: its first query loads DuckDB, a one-time jump of some tens of MB. The activations
a graph saved are live tensors, so ``torch.tensors`` counts them (with no owner: no module holds them). The fix is
``val_history.append(val_loss.item())`` under ``torch.no_grad()``. The job stops after 600 steps.
"""

import os
import time

import torch
from torch import nn

STEPS = 600


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small job: leave the other cores alone
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    held_out = torch.randn(128, 64), torch.randint(0, 10, (128,))
    val_history = []
    for step in range(STEPS):
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        val_loss = loss_fn(model(held_out[0]), held_out[1])  # the bug: no torch.no_grad() ...
        val_history.append(val_loss)  # ... and the tensor kept, not val_loss.item()
        if step % 50 == 0:
            print("step %d loss %.3f val %.3f" % (step, loss.item(), val_loss.item()), flush=True)
        if step == 10:
            print("READY", os.getpid(), flush=True)
        time.sleep(0.05)  # stands in for the wait for the next batch


if __name__ == "__main__":
    main()
