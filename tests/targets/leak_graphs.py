"""A CPU training loop that leaks: every step's loss is kept in a list with its autograd graph (``losses.append(loss)``
instead of ``loss.item()``), so each step's saved activations (about 1 MB) stay alive. About 25 MB a second;
it stops keeping losses at LEAK_CAP_MB so that a forgotten run cannot fill the machine.
Prints ``READY <pid>`` after step 5.
"""

import os
import time

import torch

LEAK_CAP_MB = 600


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(128, 64), torch.randn(128, 1)
    history = []  # the leak: losses with their graphs
    step = 0
    while True:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        opt.step()
        if len(history) < LEAK_CAP_MB:
            history.append(loss)
        step += 1
        if step == 5:
            print("READY", os.getpid(), flush=True)
        time.sleep(0.04)


main()
