"""A training job that hangs, and its weights saved anyway: an emergency checkpoint from outside.

A prefetch thread reads batches into a queue; at batch 40 it meets a record it cannot parse, raises,
and dies (its traceback goes to stderr, which nobody reads). The training loop waits on the queue for
a batch that will never come: no error, no exit, and the last checkpoint is hours old.

    PROBE=1 python examples/hung_checkpoint.py &          # prints READY <pid> once it hangs
    probe $PID backtrace                                  # MainThread: train -> Queue.get -> wait:
                                                          #   no "prefetch" thread left to fill it
    probe $PID checkpoint /tmp/ck.pt                      # model, optimizer, step 40, RNG states; taken
                                                          #   "concurrently with the training loop: no
                                                          #   optimizer step came within 2 s"
    python -c "import torch; ck = torch.load('/tmp/ck.pt'); print(ck['step'], list(ck['models']['model']))"
                                                          # -> 40 ['0.weight', '0.bias', '2.weight', ...]

``checkpoint`` waits up to 2 s for an optimizer step, to write between two steps; a hung job makes
none, so it writes alongside the loop, from a thread of the agent (``--concurrent`` skips the wait).
It needs nothing from the main thread, which is blocked in C and would never run ``eval --on main``,
and a hung job changes nothing meanwhile, so the file is consistent. It holds plain state dicts
(``torch.load`` with ``weights_only`` reads it): ``{"models": {"model": ...}, "optimizers":
{"optimizer": ...}, "step": 40, "rng": ..., "meta": ...}``, the names those of the globals of
``__main__`` that hold them, the step its ``step`` global; ``model.load_state_dict(ck["models"]["model"])``
resumes. Stop the job with Ctrl-C or ``kill $PID``.
"""

import os
import queue
import threading
import time

import torch
from torch import nn

BAD_RECORD = 40

torch.manual_seed(0)
torch.set_num_threads(1)  # a small job: leave the other cores alone
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batches: "queue.Queue[tuple]" = queue.Queue(maxsize=8)
step = 0


def parse(record: int) -> tuple:
    if record == BAD_RECORD:
        raise ValueError("record %d: truncated" % record)
    return torch.randn(16, 32), torch.randint(0, 4, (16,))


def prefetch() -> None:
    record = 0
    while True:
        batches.put(parse(record))  # the exception ends this thread; nothing tells the trainer
        record += 1


def train() -> None:
    global step
    threading.Thread(target=prefetch, name="prefetch", daemon=True).start()
    while True:
        if step == BAD_RECORD:
            print("READY", os.getpid(), flush=True)  # the queue is empty for good from here
        x, y = batches.get()  # <- where the job hangs
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 10 == 0:
            print("step %d loss %.3f" % (step, loss.item()), flush=True)
        time.sleep(0.01)  # stands in for the rest of a step


if __name__ == "__main__":
    train()
