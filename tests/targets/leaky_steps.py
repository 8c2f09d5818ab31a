"""A CPU training loop of ~10 ms steps that leaks 256 KB a step, for the trace's memory column: each step
keeps a 256 KB float32 buffer of its own (written, so resident) in a history that is never cleared.
Steps are paced by a deadline, not a sleep of fixed length, so that they stay near ``STEP_MS`` (default 10).
Prints ``READY <pid>`` before the first step, then runs until killed.
"""

import os
import time

import torch

STEP_S = float(os.environ.get("STEP_MS", "10")) / 1000.0
LEAK_FLOATS = 256 * 1024 // 4


def run() -> None:
    torch.manual_seed(1)
    torch.set_num_threads(1)
    layers = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(layers.parameters(), lr=1e-3)
    history = []
    print("READY", os.getpid(), flush=True)
    next_at = time.monotonic()
    while True:
        inputs = torch.randn(16, 32)
        opt.zero_grad(set_to_none=True)
        layers(inputs).pow(2).mean().backward()
        opt.step()
        history.append(torch.full((LEAK_FLOATS,), float(len(history))))  # 256 KB kept, every page written
        next_at += STEP_S
        pause = next_at - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_at = time.monotonic()


run()
