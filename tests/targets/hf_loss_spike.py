"""A Hugging Face Trainer (a subclass, as many scripts make one) training a tiny GPT-2 made from a config
(nothing downloaded) on CPU, logging every step (loss, learning_rate, grad_norm in its log history), whose
logged loss jumps 50 times for a few steps: the loss the Trainer logs is multiplied, the gradients are not.

    hf_loss_spike.py [--spike-at K] [--spike-steps N] [--sleep S] [--ready-at R]

Steps K .. K+N-1 (default 30, 12) log 50 x the loss; S seconds a step (default 0.25); prints
``READY <pid>`` (under torchrun ``READY <pid> <rank> <local_rank>``) after step R (default 2), and
``SPIKE <first> <last>`` with it; trains on until killed.
"""

import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


SPIKE_AT = int(_option("--spike-at", "30"))
SPIKE_STEPS = int(_option("--spike-steps", "12"))


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class SpikyTrainer(Trainer):
    def training_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        loss = super().training_step(*args, **kwargs)  # backward done: what is returned is only logged
        step = self.state.global_step + 1  # the step this batch makes
        return loss * 50 if SPIKE_AT <= step < SPIKE_AT + SPIKE_STEPS else loss


class Pace(TrainerCallback):
    def __init__(self, ready_at: int, sleep: float) -> None:
        self.ready_at, self.sleep, self.ready = ready_at, sleep, False

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if not self.ready and state.global_step >= self.ready_at:
            self.ready = True
            rank = " %s %s" % (os.environ["RANK"], os.environ["LOCAL_RANK"]) if "RANK" in os.environ else ""
            sys.stdout.write("READY %d%s\nSPIKE %d %d\n" % (os.getpid(), rank, SPIKE_AT, SPIKE_AT + SPIKE_STEPS - 1))
            sys.stdout.flush()
        time.sleep(self.sleep)


def main() -> None:
    torch.set_num_threads(1)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "hf-spike-%d" % os.getpid())
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], max_steps=100000,
                             per_device_train_batch_size=4, learning_rate=1e-3, lr_scheduler_type="linear",
                             warmup_steps=0, max_grad_norm=1.0, save_strategy="no", logging_steps=1,
                             disable_tqdm=True, dataloader_num_workers=0)
    trainer = SpikyTrainer(model=model, args=args, train_dataset=Tokens(),
                           callbacks=[Pace(int(_option("--ready-at", "2")), float(_option("--sleep", "0.25")))])
    trainer.remove_callback(PrinterCallback)  # a line a step on stdout: the test reads only READY
    trainer.train()


if __name__ == "__main__":
    main()
