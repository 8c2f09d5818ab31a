"""Injection target: a process that imported torch (hundreds of shared libraries, OpenMP threads)."""

import os
import time

import torch

if __name__ == "__main__":
    torch.set_num_threads(2)
    weights = torch.ones(64, 64) @ torch.ones(64, 64)  # start torch's thread pool
    print("READY", os.getpid(), flush=True)
    while True:
        time.sleep(0.05)
