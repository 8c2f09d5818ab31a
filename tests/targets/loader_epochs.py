"""A CPU loop over short epochs of a DataLoader (no workers), for the timed ``__next__`` of the step extras:
each epoch is 4 batches and ends in StopIteration; on every third epoch the dataset's item 5 raises
``ValueError("bad record")``, which the loop catches and counts before it starts the next epoch. An SGD
step a batch. ``ended`` (epochs that ended in StopIteration) and ``caught`` (ValueErrors caught) are globals
of ``__main__``. Prints ``READY <pid>`` after the first epoch; runs until killed.
"""

import os
import time

import torch

ended = 0
caught = 0
epoch = 0


class Records(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int):
        if index == 5 and epoch % 3 == 2:
            raise ValueError("bad record")
        time.sleep(0.002)
        return torch.full((4,), float(index))


model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = torch.utils.data.DataLoader(Records(), batch_size=2)
while True:
    try:
        for batch in loader:
            model(batch).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.01)
        ended += 1
    except ValueError as exc:
        assert str(exc) == "bad record", exc
        caught += 1
    epoch += 1
    if epoch == 1:
        print("READY", os.getpid(), flush=True)
