"""A plain CPU training loop under an LR scheduler, for ``probe TARGET lr``.

    lr_loop.py LOG [--sched lambda|step|none] [--in-function]

SGD at lr 0.01 on a tiny linear model; ``lambda``: ``LambdaLR`` with lr = base / (1 + step / 100) (it
sets lr from its base_lrs at every step, as Hugging Face's schedules do); ``step``: ``StepLR`` that
halves the lr every 100000 steps (it goes on from the group's lr). Appends ``step lr`` to LOG after
every scheduler step, prints ``READY <pid>`` after 5 steps, and trains on (a step every 20 ms).
``--in-function``: model, optimizer and scheduler are locals of ``train()``, not globals.
"""

import os
import sys
import time

import torch
from torch import nn


def decay(step: int) -> float:
    return 1.0 / (1.0 + step / 100.0)


def train(log: str, kind: str) -> None:
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if kind == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    elif kind == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100000, gamma=0.5)
    else:
        scheduler = None
    if "--in-function" not in sys.argv:
        globals().update(model=model, optimizer=optimizer, scheduler=scheduler)
    step = 0
    while True:
        x = torch.randn(16, 8)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        step += 1
        with open(log, "a") as out:
            out.write("%d %r\n" % (step, optimizer.param_groups[0]["lr"]))
        if step == 5:
            sys.stdout.write("READY %d\n" % os.getpid())
            sys.stdout.flush()
        time.sleep(0.02)


if __name__ == "__main__":
    torch.set_num_threads(1)
    train(sys.argv[1], sys.argv[sys.argv.index("--sched") + 1] if "--sched" in sys.argv else "lambda")
