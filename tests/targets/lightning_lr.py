"""A Lightning regression whose learning rate a ``LearningRateMonitor`` records (it needs a logger: a CSV
logger under LOGDIR) and which logs ``train_loss`` and ``grad_norm`` itself each step; StepLR halves the lr
every 5 steps, from 0.1.

    lightning_lr.py LOGDIR [--sleep S]

Prints ``READY <pid>`` (under torchrun ``READY <pid> <rank> <local_rank>``) once the monitor has recorded an
lr and a loss was logged; S seconds a step (default 0.2); trains until killed.
"""

import os
import sys
import time

import lightning as L
import torch
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger
from torch import nn


class Regression(L.LightningModule):
    def __init__(self, sleep: float) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.sleep, self.told = sleep, False

    def training_step(self, batch, index):  # type: ignore[no-untyped-def]
        features, target = batch
        loss = nn.functional.mse_loss(self.layer(features), target)
        self.log("train_loss", loss, on_step=True)
        time.sleep(self.sleep)
        return loss

    def on_before_optimizer_step(self, optimizer):  # type: ignore[no-untyped-def]
        norm = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in self.parameters() if p.grad is not None))
        self.log("grad_norm", norm, on_step=True)

    def on_train_batch_end(self, outputs, batch, index):  # type: ignore[no-untyped-def]
        monitor = next(c for c in self.trainer.callbacks if isinstance(c, LearningRateMonitor))
        if not self.told and any(monitor.lrs.values()) and "train_loss" in self.trainer.callback_metrics:
            self.told = True
            rank = " %s %s" % (os.environ["RANK"], os.environ["LOCAL_RANK"]) if "RANK" in os.environ else ""
            sys.stdout.write("READY %d%s\n" % (os.getpid(), rank))
            sys.stdout.flush()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=5, gamma=0.5), "interval": "step"}}


def batches() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(64, 4, generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(features, features.sum(1, keepdim=True)),
                                       batch_size=8)


def run() -> None:
    sleep = float(sys.argv[sys.argv.index("--sleep") + 1]) if "--sleep" in sys.argv else 0.2
    fitter = L.Trainer(max_steps=100000, accelerator="cpu", devices=1, logger=CSVLogger(sys.argv[1]),
                       callbacks=[LearningRateMonitor(logging_interval="step")], log_every_n_steps=1,
                       enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    fitter.fit(Regression(sleep), batches())


if __name__ == "__main__":
    run()
