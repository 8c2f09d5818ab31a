"""A training loop whose DataLoader (num_workers=2) hangs: the read of sample HANG_INDEX never returns, so
worker 1, which makes the batch holding it, hangs and the main thread waits for that batch forever.

Prints ``WORKERS <worker0_pid> <worker1_pid>``, then ``READY <pid>`` once the main thread waits for the
hung batch.
"""

import os
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

HANG_INDEX = 13  # batch 3 (samples 12-15), which worker 1 makes (batches go to workers 0, 1, 0, 1, ...)


class Samples(Dataset):
    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == HANG_INDEX:
            parent = os.getppid()
            while os.getppid() == parent:  # hangs while the trainer lives; leaves once it is gone
                time.sleep(0.2)
            os._exit(1)
        return torch.full((8,), float(index % 7))


def announce(loader_iter: object) -> None:
    """READY once the main thread is inside __next__ waiting for batch 3."""
    pids = [w.pid for w in loader_iter._workers]  # type: ignore[attr-defined]
    while getattr(loader_iter, "_rcvd_idx", 0) < 3:
        time.sleep(0.05)
    time.sleep(0.3)
    print("WORKERS", *pids, flush=True)
    print("READY", os.getpid(), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    loader = DataLoader(Samples(), batch_size=4, num_workers=2, prefetch_factor=2)
    batches = iter(loader)
    threading.Thread(target=announce, args=(batches,), daemon=True).start()
    for _batch in batches:
        time.sleep(0.01)


if __name__ == "__main__":
    main()
