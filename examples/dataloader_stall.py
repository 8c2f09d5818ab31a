"""A training job whose DataLoader stalls: one sample's read never returns, so a worker hangs forever.

The dataset reads each sample from "storage"; the read of sample 700 never returns (think of a file on
an NFS mount that went away). With ``num_workers=1`` that read runs in a worker process, and the
training loop waits for the worker's batch: ``DataLoader(timeout=0)``, the default, waits forever, so
there is no error and no exit; the log simply stops.

    PROBE=1 python examples/dataloader_stall.py &        # prints READY <pid> at step 20, then stalls
    probe $PID backtrace                                  # MainThread: main -> __next__ -> _next_data ->
                                                          #   _get_data -> _try_get_data -> Queue.get -> poll
    probe $PID eval "import multiprocessing as mp; [(c.name, c.pid) for c in mp.active_children()]"
                                                          # -> [('Process-1', WORKER_PID)]: the worker
    probe list                                            # the worker: agent "no", "probe WORKER_PID inject"
    probe $WORKER_PID backtrace                           # the worker runs no agent: read from outside
                                                          #   (py-spy; stderr says so): _worker_loop ->
                                                          #   fetch -> Samples.__getitem__ -> read_sample
    probe $WORKER_PID backtrace --native                  # the same with the C frames (-> sleep)
    probe $WORKER_PID inject                              # or start an agent in the worker (needs gdb) ...
    probe $WORKER_PID query "SELECT func, name, value FROM python.locals WHERE name = 'index'"
                                                          # -> read_sample and __getitem__: index 700;
                                                          #    _worker_loop: [672, 673, ...], its batch

The worker is a child process forked by the DataLoader. The agent does not follow a fork (a child
must not answer on its parent's socket), so the worker runs no agent although ``PROBE=1`` is in its
environment, and ``probe list`` offers ``inject`` as the way in.
``backtrace`` of a process without an agent reads its stacks from outside and says so on stderr
(``--native`` adds the C frames); eval and the other tables need the agent that ``inject`` starts.
The stalled read leaves once the trainer is gone, so killing ``$PID`` leaves no worker behind.
"""

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

STALLED_INDEX = 700  # the sample whose read never returns (batch 21: samples 672-703)


def read_sample(index: int) -> torch.Tensor:
    """The storage: the read of STALLED_INDEX never returns while the trainer lives."""
    if index == STALLED_INDEX:
        trainer = os.getppid()
        while os.getppid() == trainer:  # never returns while the trainer lives; once it is gone, leave
            time.sleep(0.5)  # <- where the worker hangs
        os._exit(1)
    generator = torch.Generator().manual_seed(index)
    return torch.randn(32, generator=generator)


class Samples(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int):
        x = read_sample(index)
        return x, (x.sum() > 0).long()


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # a small job: leave the other cores alone
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Samples(), batch_size=32, num_workers=1)
    for step, (x, y) in enumerate(loader):  # the loader waits here, forever, for batch 21
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            print("step %d loss %.3f" % (step, loss.item()), flush=True)
        if step == 20:
            print("READY", os.getpid(), flush=True)  # the next batch is the one that never comes


if __name__ == "__main__":
    main()
