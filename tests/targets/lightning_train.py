"""A Lightning module trained by a Lightning Trainer on CPU: a small regression net, AdamW and a
per-step LambdaLR scheduler, a synthetic dataset of one batch (so one step an epoch: Lightning resumes
an unfinished epoch from its first batch, its data loader keeping no position, and a checkpoint
taken between two steps is then at an epoch's start, where a resumed run goes on exactly as the
first one); nothing downloaded.

    lightning_train.py LOG [--max-steps N] [--sleep S] [--resume CKPT] [--ready-at K] [--ddp]

Appends ``global_step lr weight_sum`` to LOG after every batch (once Lightning has stepped the
scheduler and counted the step), prints ``READY <pid>`` after step K (default 2), sleeps S seconds a
step (default 0.1), exits when the run ends. ``--resume CKPT``: ``trainer.fit(model, ckpt_path=CKPT)``.
``--ddp``: two processes (strategy ddp, gloo, as ``python lightning_train.py ...`` both: rank 0 starts
rank 1 with the same command line), each printing ``READY <pid> <rank> <local_rank>`` in one write after
step K; rank 0 alone writes LOG.
"""

import os
import sys
import time

import lightning as L
import torch
from torch import nn


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, index):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Log(L.Callback):
    def __init__(self, path: str, ready_at: int, sleep: float) -> None:
        self.path, self.ready_at, self.sleep, self.ready = path, ready_at, sleep, False

    def on_train_batch_end(self, trainer, module, outputs, batch, index):  # type: ignore[no-untyped-def]
        weights = sum(float(p.detach().double().sum()) for p in module.parameters())
        lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
        if trainer.global_rank == 0:
            with open(self.path, "a") as log:
                log.write("%d %r %r\n" % (trainer.global_step, lr, weights))
        if not self.ready and trainer.global_step >= self.ready_at:
            self.ready = True
            if trainer.world_size > 1:  # the ranks share the launcher's stdout: one write a line
                sys.stdout.write("READY %d %d %d\n" % (os.getpid(), trainer.global_rank, trainer.local_rank))
            else:
                sys.stdout.write("READY %d\n" % os.getpid())
            sys.stdout.flush()
        time.sleep(self.sleep)


def data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))


def main() -> None:
    torch.manual_seed(0)
    model = Regression()
    ddp = "--ddp" in sys.argv
    trainer = L.Trainer(max_steps=int(_option("--max-steps", "24")), accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        devices=2 if ddp else 1, strategy="ddp" if ddp else "auto",
                        callbacks=[Log(sys.argv[1], int(_option("--ready-at", "2")), float(_option("--sleep", "0.1")))])
    trainer.fit(model, data(), ckpt_path=_option("--resume", "") or None)


if __name__ == "__main__":
    main()
