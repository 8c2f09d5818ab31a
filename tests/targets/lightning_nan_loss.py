"""A Lightning classifier whose data hold a NaN from the start, so the loss it logs (``train_loss``) is
nan at every step; each step takes ~3 s (a slow model, here a wait in the step), longer than diagnose
waits for a step's end to read the parameters.

    lightning_nan_loss.py

Prints ``READY <pid>`` once the Trainer has logged a loss; trains until killed.
"""

import os
import sys
import time

import lightning as L
import torch
from torch import nn


class Classifier(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 3))
        self.told = False

    def training_step(self, batch, index):  # type: ignore[no-untyped-def]
        features, labels = batch
        loss = nn.functional.cross_entropy(self.layers(features), labels)
        self.log("train_loss", loss, on_step=True, prog_bar=False)
        time.sleep(3.0)
        return loss

    def on_train_batch_end(self, outputs, batch, index):  # type: ignore[no-untyped-def]
        if not self.told and "train_loss" in self.trainer.callback_metrics:
            self.told = True
            sys.stdout.write("READY %d\n" % os.getpid())
            sys.stdout.flush()

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batches() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(40, 5, generator=generator)
    features[11, 2] = float("nan")
    labels = torch.randint(0, 3, (40,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(features, labels), batch_size=40)


def run() -> None:
    classifier = Classifier()
    fitter = L.Trainer(max_steps=100000, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                       enable_progress_bar=False, enable_model_summary=False)
    fitter.fit(classifier, batches())


if __name__ == "__main__":
    run()
