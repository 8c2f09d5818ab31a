"""A gloo job that averages a small metrics vector across ranks every round, for ``probe diagnose``'s
mismatched-collective verdict: a test names a rank in ``MISMATCH_CONTROL`` (a file) and that rank then
shares its metrics with ``broadcast`` (a float64 vector of another length) where every other rank calls
``all_reduce``: under the same collective number, each rank waits in its own collective.

The control file holds words, one a line: ``bcast R`` (rank R broadcasts from the next round on),
``dump`` (every rank writes torch's own Flight Recorder dump, ``_dump_fr_trace()``'s bytes, to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` from a watcher thread, once: the main thread is stuck by then). Each rank
prints ``READY <pid> <rank> <local_rank>`` after its fifth round.
"""

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

CONTROL = os.environ.get("MISMATCH_CONTROL", "")


def orders() -> list:
    try:
        with open(CONTROL) as handle:
            return [line.split() for line in handle.read().splitlines() if line.strip()]
    except OSError:
        return []


def odd_rank() -> int:
    return next((int(w[1]) for w in orders() if len(w) == 2 and w[0] == "bcast" and w[1].isdigit()), -1)


def dump_when_told(rank: int) -> None:
    from torch._C._distributed_c10d import _dump_fr_trace

    while not any(w == ["dump"] for w in orders()):
        time.sleep(0.1)
    path = os.environ["TORCH_FR_DUMP_TEMP_FILE"] + str(rank)
    with open(path + ".part", "wb") as handle:
        handle.write(_dump_fr_trace())
    os.replace(path + ".part", path)


def share_metrics(rank: int, metrics: torch.Tensor) -> torch.Tensor:
    if rank == odd_rank():
        wide = torch.cat([metrics, metrics]).double()
        dist.broadcast(wide, src=rank)  # the odd one out: another op, length and dtype
        return metrics
    dist.all_reduce(metrics)
    return metrics / dist.get_world_size()


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if os.environ.get("TORCH_FR_DUMP_TEMP_FILE"):
        threading.Thread(target=dump_when_told, args=(rank,), daemon=True, name="fr-dumper").start()
    rounds = 0
    metrics = torch.zeros(3)
    while True:
        metrics = share_metrics(rank, metrics + torch.tensor([1.0, rank, 0.5]))
        rounds += 1
        if rounds == 5:
            sys.stdout.write("READY %d %d %s\n" % (os.getpid(), rank, os.environ.get("LOCAL_RANK")))
            sys.stdout.flush()
        time.sleep(0.02)


main()
