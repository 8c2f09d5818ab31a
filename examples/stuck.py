"""A training loop that hangs: rank 0 waits forever in a collective that its peer never joins.

Run it with an agent and look inside without stopping it:

    PROBE=1 python examples/stuck.py &
    probe $! backtrace
"""

import os
import queue
import threading
import time

batches: "queue.Queue[list]" = queue.Queue(maxsize=4)
peer_arrived = threading.Event()  # never set: the peer rank is gone
step = 0
loss = 2.31


def data_loader() -> None:
    n = 0
    while True:
        batches.put([n] * 8)  # blocks once the queue is full: the trainer stopped consuming
        n += 1


def all_reduce(tensor: list) -> list:
    peer_arrived.wait()  # <- where the job hangs
    return tensor


def train_step(batch: list) -> float:
    grads = [x * 0.01 for x in batch]
    all_reduce(grads)
    return loss * 0.99


def train() -> None:
    global step, loss
    threading.Thread(target=data_loader, name="data-loader", daemon=True).start()
    print("READY", os.getpid(), flush=True)
    while True:
        loss = train_step(batches.get())
        step += 1
        time.sleep(0.01)


if __name__ == "__main__":
    train()
