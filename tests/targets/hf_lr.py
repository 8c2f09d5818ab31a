"""A Hugging Face Trainer built inside ``main()`` (as transformers' example scripts build it) training a
tiny GPT-2 made from a config (nothing downloaded) on CPU, for ``probe TARGET lr``.

    hf_lr.py LOG

The Trainer's own schedule: ``LambdaLR``, linear decay from lr 1e-3 over 100000 steps, so it sets lr
from its base_lrs at every step. Appends ``global_step lr`` to LOG after every step (a callback, after
the Trainer stepped its scheduler), prints ``READY <pid>`` after step 3, and trains on (20 ms a step).
"""

import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 32, (64, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Log(TrainerCallback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):  # type: ignore[no-untyped-def]
        with open(self.path, "a") as log:
            log.write("%d %r\n" % (state.global_step, lr_scheduler.get_last_lr()[0]))
        if state.global_step == 3:
            sys.stdout.write("READY %d\n" % os.getpid())
            sys.stdout.flush()
        time.sleep(0.02)


def main() -> None:
    log = sys.argv[1]
    torch.set_num_threads(1)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=16))
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(log), "hf-out"), use_cpu=True, report_to=[],
                             max_steps=100000, per_device_train_batch_size=4, learning_rate=1e-3,
                             lr_scheduler_type="linear", save_strategy="no", logging_steps=100000, disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Log(log)])
    trainer.train()


if __name__ == "__main__":
    main()
