"""A benchmark target: a ~100 M-parameter model and its optimizer in ``__main__``, and a busy main loop.

    python bench/targets/big_model.py [--layers 6] [--width 4096]

The model is ``--layers`` Linear(width, width) layers (6 x 4096^2 + biases = 100.7 M parameters,
403 MB of float32), the optimizer SGD with momentum (its buffers set by one step: another 403 MB).
The main loop stands for a training loop that calls into torch every iteration (a small in-place op)
and records the longest gap between two iterations. A thread reads stdin: on each line the main loop
prints ``GAP <ms>`` (the longest gap since the previous line) and starts a new window; the iteration
that sees the request is left out. Prints ``READY <pid>`` when ready. Dies with its parent.
"""

import argparse
import ctypes
import os
import signal
import sys
import threading
import time

import torch
from torch import nn


def die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:
        os._exit(1)


def main() -> None:
    global model, optimizer, step
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    die_with_parent()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    model(torch.randn(2, args.width)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    step = 1
    asked = threading.Event()

    def read_requests() -> None:
        for _ in sys.stdin:
            asked.set()

    threading.Thread(target=read_requests, daemon=True).start()
    sys.stdout.write("READY %d\n" % os.getpid())
    sys.stdout.flush()
    small = torch.zeros(64)
    longest = 0.0
    last = time.perf_counter()
    while True:
        small.add_(1.0)
        now = time.perf_counter()
        if asked.is_set():
            asked.clear()
            sys.stdout.write("GAP %.3f\n" % (longest * 1000.0))
            sys.stdout.flush()
            longest = 0.0
            now = time.perf_counter()
        elif now - last > longest:
            longest = now - last
        last = now


if __name__ == "__main__":
    main()
