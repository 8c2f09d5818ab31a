"""A job started as ``torch.multiprocessing.spawn`` starts one: this process only waits, its two children
are the ranks and learn their rank from ``init_process_group("gloo")`` alone (no RANK/LOCAL_RANK in their
environment). Each child prints ``RANK <rank> <pid>`` once the group is up; then this process prints
``READY <pid>``. SIGTERM here ends the children too (they leave when their parent is gone)."""

import os
import signal
import sys
import time


def rank_main(rank: int, world: int, port: int, parent: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank, world_size=world)
    sys.stdout.write("RANK %d %d\n" % (rank, os.getpid()))
    sys.stdout.flush()
    while os.getppid() == parent:
        time.sleep(0.1)
    os._exit(0)


def main() -> None:
    import torch.multiprocessing as mp

    port = int(sys.argv[1])
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    context = mp.spawn(rank_main, args=(2, port, os.getpid()), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while sum(p.is_alive() for p in context.processes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    print("READY", os.getpid(), flush=True)
    context.join()


if __name__ == "__main__":
    main()
