"""A benchmark target for bench_metrics.py: a training loop (a small MLP on the CPU, one intra-op thread),
counted in one of two ways.

    python bench/targets/metrics_loop.py probe          # nothing in the loop: probe's step counter counts it
    python bench/targets/metrics_loop.py exporter PORT  # the peer: a hand-written prometheus_client exporter
                                                        # in the rank (a counter and gauges set every step,
                                                        # its HTTP server on 127.0.0.1:PORT in this process)

Prints ``READY <pid>`` after 3 steps. A line ``report`` on stdin (checked once a step, without waiting)
prints ``TIMES <steps> <median step s> <CPU s a step>`` of the steps since the last report.
"""

import os
import select
import statistics
import sys
import time

import torch


def main() -> None:
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "exporter":
        from prometheus_client import Counter, Gauge, start_http_server

        labels = {"rank": os.environ.get("RANK", "0"), "local_rank": os.environ.get("LOCAL_RANK", "0")}
        steps_total = Counter("train_steps", "Optimizer steps.", list(labels)).labels(**labels)
        step_time = Gauge("train_step_time_seconds", "The last step's time.", list(labels)).labels(**labels)
        last_step = Gauge("train_last_step_timestamp_seconds", "When the last step ended.", list(labels)).labels(**labels)
        start_http_server(int(sys.argv[2]), addr="127.0.0.1")
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
        if mode == "exporter":
            steps_total.inc()
            step_time.set(times[-1])
            last_step.set(time.time())
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
