"""A Hugging Face Trainer built inside ``main()``, as transformers' example scripts do, training a tiny
GPT-2 (from a config: nothing downloaded) on a tiny synthetic dataset, on CPU.

    hf_trainer.py LOG [--max-steps N] [--sleep S] [--resume DIR] [--ready-at K] [--nan-at K]

Appends ``global_step lr weight_sum`` to LOG after every optimizer step (from a callback, once the
Trainer has stepped its scheduler and counted the step), prints ``READY <pid>`` after step K
(default 2), sleeps S seconds a step (default 0.1) so that a checkpoint lands mid-run, and exits
when the run ends. ``--resume DIR``: ``trainer.train(resume_from_checkpoint=DIR)``. Under torchrun
the Trainer wraps the model in DDP (gloo), every rank prints ``READY <pid> <rank> <local_rank>`` and
LOG gets the rank's number appended (``LOG.1``) on ranks other than 0. ``--nan-at K``: after step K a
weight is NaN (so is every loss after), the loss is logged every step and NaN is logged as it is
(``logging_nan_inf_filter`` off).
"""

import os
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


def _option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def tiny_config() -> GPT2Config:
    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (48, 16), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class Log(TrainerCallback):
    def __init__(self, path: str, ready_at: int, sleep: float, nan_at: int = 0) -> None:
        self.path, self.ready_at, self.sleep, self.ready, self.nan_at = path, ready_at, sleep, False, nan_at

    def on_step_end(self, args, state, control, model=None, lr_scheduler=None, **kwargs):  # type: ignore[no-untyped-def]
        if self.nan_at and state.global_step == self.nan_at:
            with torch.no_grad():
                next(model.parameters()).view(-1)[0] = float("nan")
        weights = sum(float(p.detach().double().sum()) for p in model.parameters())
        with open(self.path, "a") as log:
            log.write("%d %r %r\n" % (state.global_step, lr_scheduler.get_last_lr()[0], weights))
        if not self.ready and state.global_step >= self.ready_at:
            self.ready = True
            rank = " %s %s" % (os.environ["RANK"], os.environ["LOCAL_RANK"]) if "RANK" in os.environ else ""
            sys.stdout.write("READY %d%s\n" % (os.getpid(), rank))
            sys.stdout.flush()
        time.sleep(self.sleep)


def main() -> None:
    log = sys.argv[1]
    if int(os.environ.get("RANK", "0")):
        log += "." + os.environ["RANK"]
    model = GPT2LMHeadModel(tiny_config())
    nan_at = int(_option("--nan-at", "0"))
    args = TrainingArguments(output_dir=os.path.join(os.path.dirname(log), "hf-out"), use_cpu=True, report_to=[],
                             max_steps=int(_option("--max-steps", "24")), per_device_train_batch_size=4,
                             learning_rate=1e-3, warmup_steps=3, lr_scheduler_type="linear", save_strategy="no",
                             logging_steps=1 if nan_at else 1000, logging_nan_inf_filter=not nan_at,
                             disable_tqdm=True, seed=7, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(),
                      callbacks=[Log(log, int(_option("--ready-at", "2")), float(_option("--sleep", "0.1")), nan_at)])
    trainer.train(resume_from_checkpoint=_option("--resume", "") or None)


if __name__ == "__main__":
    main()
