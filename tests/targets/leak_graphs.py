"""A CPU training loop that leaks: every step's loss is kept in a list with its autograd graph (``losses.append(loss)``
instead of ``loss.item()``), so each step's saved activations stay alive. Prints ``READY <pid>`` after step 5.

Two shapes, chosen by the first argument:

* ``graphs`` (the default): hidden width 1024, about 1 MB of activations a step, 25 steps a second: about
  25 MB a second, all of it in tensors;
* ``mixed``: hidden width 256 (about 128 KB a step) and 1 MB of plain bytes kept each step as well, 10 steps
  a second: RSS grows about eight times faster than the tensors, and the largest holder of tensors grows
  all the same.

Either stops keeping anything after ``KEEP_STEPS`` so that a forgotten run cannot fill the machine.
"""

import os
import sys
import time

import torch

SHAPES = {"graphs": (1024, False, 0.04, 600), "mixed": (256, True, 0.1, 400)}  # width, bytes too, pause, KEEP_STEPS


def main(shape: str) -> None:
    width, with_bytes, pause, keep_steps = SHAPES[shape]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(128, 64), torch.randn(128, 1)
    losses, blobs = [], []  # the leaks: losses with their graphs, and (mixed) plain bytes
    step = 0
    while True:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        opt.step()
        if step < keep_steps:
            losses.append(loss)
            if with_bytes:
                blobs.append(bytearray(os.urandom(1 << 20)))
        step += 1
        if step == 5:
            print("READY", os.getpid(), flush=True)
        time.sleep(pause)


main(sys.argv[1] if len(sys.argv) > 1 else "graphs")
