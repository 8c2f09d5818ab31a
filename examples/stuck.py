"""A training loop that hangs: at step 5 the trainer and the checkpoint writer take the same two locks in
opposite orders, and each waits for the one the other holds (a deadlock), while the data loader fills its
queue and blocks.

Run it with an agent and look inside without stopping it:

    PROBE=1 python examples/stuck.py &
    probe $! diagnose      # STUCK: a deadlock, which thread holds which lock, where
    probe $! backtrace
"""

import os
import queue
import threading
import time

batches: "queue.Queue[list]" = queue.Queue(maxsize=4)
weights = threading.Lock()  # the model's parameters
metrics = threading.Lock()  # the running loss and step, read by the checkpoint writer
checkpoint_due = threading.Event()
writing = threading.Event()  # the checkpoint writer has taken the metrics
CHECKPOINT_AT = 5
step = 0
loss = 2.31


def data_loader() -> None:
    n = 0
    while True:
        batches.put([n] * 8)  # blocks once the queue is full: the trainer stopped consuming
        n += 1


def checkpoint_writer() -> None:
    checkpoint_due.wait()
    with metrics:  # first the metrics, to name the checkpoint after its step
        writing.set()
        print("READY", os.getpid(), flush=True)  # the hang is a moment away: the trainer holds the weights
        with weights:  # then the weights: the trainer holds them and waits for the metrics
            pass


def train_step(batch: list) -> float:
    global step
    with weights:
        grads = [x * 0.01 for x in batch]
        if step + 1 == CHECKPOINT_AT:
            checkpoint_due.set()
            writing.wait()
        with metrics:  # the checkpoint writer holds them and waits for the weights
            step += 1
    return loss * 0.99 + 0 * sum(grads)


def train() -> None:
    global loss
    threading.Thread(target=data_loader, name="data-loader", daemon=True).start()
    threading.Thread(target=checkpoint_writer, name="checkpoint-writer", daemon=True).start()
    while True:
        loss = train_step(batches.get())
        time.sleep(0.01)


if __name__ == "__main__":
    train()
