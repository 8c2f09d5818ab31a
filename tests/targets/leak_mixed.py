"""A CPU training loop whose memory grows two ways at once: every step's loss is kept with its autograd graph
(its saved [128, 256] activations, about 128 KB a step, stay alive), and every step also keeps 1 MB of
bytes. RSS grows about eight times faster than the tensors; the largest holder of tensors grows all the
same. 10 steps a second; it stops keeping anything after KEEP_STEPS so that a forgotten run cannot fill
the machine. Prints ``READY <pid>`` after step 5.
"""

import os
import time

import torch

KEEP_STEPS = 400


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(128, 64), torch.randn(128, 1)
    losses, blobs = [], []  # the leaks: losses with their graphs, and plain bytes
    step = 0
    while True:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward(retain_graph=True)
        opt.step()
        if step < KEEP_STEPS:
            losses.append(loss)
            blobs.append(bytearray(os.urandom(1 << 20)))
        step += 1
        if step == 5:
            print("READY", os.getpid(), flush=True)
        time.sleep(0.1)


main()
