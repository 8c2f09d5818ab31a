"""A benchmark target for bench_stack_history.py's peers: a training loop (a small MLP on the CPU, one intra-op
thread) in a one-rank gloo process group, with torch's debug server started in it
(``torch.distributed.debug.start_debug_server``: a worker server in this process that answers for its
stacks, and on rank 0 the frontend, a child process) and, with ``PROBE=1``, probe's agent.

    RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=P DEBUG_PORT=Q python bench/targets/stacks_loop.py

Prints ``READY <pid>`` after 3 steps. A line ``report`` on stdin (checked once a step, without waiting)
prints ``TIMES <steps> <median step s> <CPU s a step>`` of the steps since the last report.
"""

import os
import select
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.debug import start_debug_server

    start_debug_server(port=int(os.environ["DEBUG_PORT"]), dump_dir=None)  # the bench drives the periodic dumps
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(64, 256)
    times, step = [], 0
    cpu_at, steps_at = time.process_time(), 0
    before = time.perf_counter()
    while True:
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        now = time.perf_counter()
        times.append(now - before)
        before = now
        step += 1
        if step == 3:
            sys.stdout.write("READY %d\n" % os.getpid())
            sys.stdout.flush()
        if select.select([sys.stdin], [], [], 0)[0]:
            line = sys.stdin.readline()
            if not line:
                return
            if line.strip() == "report":
                cpu = time.process_time()
                sys.stdout.write("TIMES %d %.6f %.6f\n" % (len(times), statistics.median(times or [0.0]),
                                                          (cpu - cpu_at) / max(1, step - steps_at)))
                sys.stdout.flush()
                times, cpu_at, steps_at = [], cpu, step
                before = time.perf_counter()


main()
