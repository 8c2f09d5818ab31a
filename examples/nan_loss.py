"""A training job whose loss turns NaN: one poisoned batch, and every weight is NaN after it.

Each sample is normalised by its own standard deviation. Sample 1000 is a sensor that got stuck: all
its readings are equal, its standard deviation is 0, and 0 / 0 is NaN. Batch 31 holds it; its loss is
NaN, its gradients are NaN, and the optimizer step writes NaN into every weight, so every later loss
is NaN too, whatever the data. The log says only that the loss is NaN; the question is where it began.

    PROBE=1 PROBE_TORCH_TRACE=1 PROBE_TORCH_TRACE_ANOMALIES=1 python examples/nan_loss.py &
                                                          # trace and screen from the first step;
                                                          # prints READY <pid> once the loss is NaN
    probe $PID query "SELECT step, module, stage, kind, nan_count, shape, loss FROM torch.anomalies
                      ORDER BY step, seq LIMIT 1"        # -> step 31, Net, input, 16 NaN in [32, 16]:
                                                          #    one sample's row of the batch given to the
                                                          #    model, before any layer ran
    probe $PID query "SELECT name, shape, has_nan FROM torch.parameters"
                                                          # -> every weight NaN now: restore from before 31
    probe $PID eval --frame MainThread:main "[i for i in range(len(dataset)) if dataset[i][0].isnan().any()]"
                                                          # -> [1000]: the sample itself

The first anomaly names where NaN first appeared: later steps show it everywhere, from the poisoned
weights. Stage ``input`` says the batch brought it: the model's inputs are screened before any of its
layers runs, and no layer is blamed for that step. Without the environment variables the screening
starts with ``probe $PID trace start --anomalies``, and sees only the steps after it (numbered from 0
there, not as the loop counts them). The job stops after 2000 steps.
"""

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

STEPS = 2000
STUCK_SENSOR = 1000  # in batch 1000 // 32 = 31


class Readings(Dataset):
    """Sensor readings, each sample normalised by its own mean and standard deviation."""

    def __init__(self, size: int = 4096) -> None:
        generator = torch.Generator().manual_seed(0)
        self.raw = torch.randn(size, 16, generator=generator) * 3 + 10
        self.raw[STUCK_SENSOR] = 7.0  # every reading equal: std 0
        self.labels = (self.raw[:, 0] > 10).long()

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int):
        x = self.raw[index]
        return (x - x.mean()) / x.std(), self.labels[index]  # 0 / 0 = NaN for the stuck sensor


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small job: leave the other cores alone
    dataset = Readings()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    while True:
        for x, y in DataLoader(dataset, batch_size=32):
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 10 == 0:
                print("step %d loss %.3f" % (step, loss.item()), flush=True)
            if step == STUCK_SENSOR // 32 + 2:
                print("READY", os.getpid(), flush=True)  # the loss has been NaN for two steps
            step += 1
            if step == STEPS:
                return
            time.sleep(0.01)  # stands in for the wait for the next batch


if __name__ == "__main__":
    main()
