"""A training job started with a learning rate far too small, fixed while it runs: no restart.

The loss barely moves: the learning rate is 1e-4 where 0.05 would do. Restarting loses the steps done
(and, in a real job, the queue slot); instead set the rate in the live optimizer, between two steps.

    PROBE=1 python examples/live_lr.py &                  # prints READY <pid> after 20 steps
    probe $PID query "SELECT class, group_index, lr, momentum, params_of FROM torch.optimizers"
                                                          # -> torch.optim.sgd.SGD, lr 0.0001
    probe $PID eval --between-steps "for group in optimizer.param_groups: group['lr'] = 0.05"
    probe $PID query "SELECT class, group_index, lr FROM torch.optimizers"   # -> lr 0.05
                                                          # the log: "lr 0.05", the loss falls to ~0

``--between-steps`` runs the snippet right after an optimizer step, on the training thread: the next
step is the first with the new rate, and no step runs half with one rate and half with the other. The
snippet runs in ``__main__``, where this script keeps ``model`` and ``optimizer``; for a script that
keeps them in a function, add ``--frame MainThread:FUNCTION``. With an LR scheduler, look again a few
steps later: some (``LambdaLR``) compute the rate from their own ``base_lrs`` at every ``step()`` and
set it back. The job stops after 3000 steps.
"""

import os
import time

import torch
from torch import nn

STEPS = 3000

torch.manual_seed(0)
torch.set_num_threads(1)  # a small job: leave the other cores alone
true_weights = torch.randn(16, 1)
model = nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)  # far too small: the loss hardly moves
step = 0


def train() -> None:
    global step
    while step < STEPS:
        x = torch.randn(64, 16)
        loss = nn.functional.mse_loss(model(x), x @ true_weights)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0:
            print("step %d lr %g loss %.4f" % (step, optimizer.param_groups[0]["lr"], loss.item()), flush=True)
        if step == 20:
            print("READY", os.getpid(), flush=True)
        step += 1
        time.sleep(0.01)  # stands in for the wait for the next batch


if __name__ == "__main__":
    train()
