"""A small CPU training loop whose model and losses live in ``main()``'s locals, not in ``__main__``.

Each step sets every parameter's ``.grad`` to None (``zero_grad``), runs backward, then the optimizer
step: right after a step no ``.grad`` is None; in the middle of one, some may be.
"""

import os

import torch


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(256, 256), torch.randn(256, 1)
    losses = []
    step = 0
    while True:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        del losses[:-1000]
        step += 1
        if step == 1:
            print("READY", os.getpid(), flush=True)


main()
