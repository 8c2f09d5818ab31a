"""A plain accelerate loop in one process on the CPU: gradient accumulation over 2 batches, AdamW, short epochs.

    accelerate_loop.py LOG

Appends the optimizer steps really taken to LOG after each one (the count lives in ``fit()``'s locals, where
probe's step search does not look), prints ``READY <pid>`` after 6, and trains until killed.
"""

import os
import sys
import time

import torch
from accelerate import Accelerator


def fit(log_path: str) -> None:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 1))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3)
    data = torch.utils.data.DataLoader(torch.randn(12, 5), batch_size=2)  # 6 batches: 3 optimizer steps an epoch
    net, opt, data = accelerator.prepare(net, opt, data)
    taken, told = 0, False
    while True:
        for batch in data:
            with accelerator.accumulate(net):
                accelerator.backward(net(batch).square().mean())
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                taken += 1
                with open(log_path, "a") as log:
                    log.write("%d\n" % taken)
                if taken >= 6 and not told:
                    told = True
                    sys.stdout.write("READY %d\n" % os.getpid())
                    sys.stdout.flush()
                time.sleep(0.3)


if __name__ == "__main__":
    fit(sys.argv[1])
