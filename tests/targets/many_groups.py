"""A CPU loop that steps as fast as it can: Adam over 64 param groups of one small tensor each, so that
one optimizer step and one read of every group both take a while (for the step-straddle test).

Model and optimizer live in ``__main__``. Prints ``READY <pid>`` after the first step.
"""

import os

import torch

torch.set_num_threads(1)
params = [torch.nn.Parameter(torch.randn(8)) for _ in range(64)]
optimizer = torch.optim.Adam([{"params": [p], "lr": 1e-3 * (i + 1)} for i, p in enumerate(params)],
                             foreach=False)
step = 0
while True:
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    step += 1
    if step == 1:
        print("READY", os.getpid(), flush=True)
