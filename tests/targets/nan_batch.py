"""A CPU training loop whose batch of step 3 holds a NaN, with a model that returns its loss in a dict,
as Hugging Face models do (ModelOutput is a dict): ``{"loss": ..., "logits": ...}``. The loss is a
nansum, so it stays finite while every output is NaN. Prints ``READY <pid>`` after step 6.
"""

import os
import time

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> dict:
        out = self.body(x)
        return {"loss": torch.nansum(out * out) / out.numel() + 1.0, "logits": out}


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    step = 0
    while True:
        x = torch.randn(4, 8)
        if step == 3:
            x[1, 2] = float("nan")
        loss = model(x)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step == 6:
            print("READY", os.getpid(), flush=True)
        time.sleep(0.01)


if __name__ == "__main__":
    main()
