"""A benchmark target for the stall watch: one rank of a torchrun gloo job training a small MLP (forward,
backward, an all_reduce of the loss, an optimizer step), one intra-op thread.

    torchrun --nproc-per-node N bench/targets/watch_train.py

``STEP_SLEEP`` (seconds, default 0) is slept in each step. ``TORCH_DEBUG_PORT``: torch's own debug server
(``torch.distributed.debug.start_debug_server``, its frontend on that port on rank 0, a worker server on
every rank) is started after ``init_process_group``, for the peers' side of ``bench_profile.py``. Prints ``READY <pid> <rank> <local_rank>``
after 3 steps. Reads ``WATCH_CONTROL`` (a file) before each step, one order a line:

- ``skip R``: rank R calls no collective any more (the others wait in all_reduce: a hang);
- ``measure``: from now on, each step's wall time is kept;
- ``report``: prints ``TIMES <rank> <n> <median> <q1> <q3> <min> <max>`` (seconds) of the steps kept,
  once, and goes on stepping.
"""

import os
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

CONTROL = os.environ.get("WATCH_CONTROL", "")
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))


def orders() -> list:
    try:
        with open(CONTROL) as handle:
            return [line.split() for line in handle.read().splitlines()]
    except OSError:
        return []


def load_next_batch(rank: int) -> None:
    while ["skip", str(rank)] in orders():
        threading.Event().wait(0.2)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if os.environ.get("TORCH_DEBUG_PORT"):
        from torch.distributed.debug import start_debug_server

        start_debug_server(port=int(os.environ["TORCH_DEBUG_PORT"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(32, 128)
    step, kept, reported = 0, [], False
    measuring = False
    while True:
        said = orders()
        if ["skip", str(rank)] in said:
            load_next_batch(rank)
        measuring = measuring or ["measure"] in said
        if ["report"] in said and not reported:
            reported = True
            data = sorted(kept) or [0.0]
            q1, _, q3 = statistics.quantiles(data, n=4, method="inclusive") if len(data) > 1 else (data[0],) * 3
            sys.stdout.write("TIMES %d %d %.6f %.6f %.6f %.6f %.6f\n" % (rank, len(kept), statistics.median(data),
                                                                        q1, q3, data[0], data[-1]))
            sys.stdout.flush()
        start = time.perf_counter()
        if STEP_SLEEP:
            time.sleep(STEP_SLEEP)
        loss = model(batch).pow(2).mean()
        loss.backward()
        dist.all_reduce(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        if measuring and not reported:
            kept.append(time.perf_counter() - start)
        step += 1
        if step == 3:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
