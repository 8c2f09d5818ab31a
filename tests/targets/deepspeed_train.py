"""A 2-rank DeepSpeed job on the CPU (gloo): ZeRO stage 1, DeepSpeed's own Adam and WarmupDecayLR made from
its config by ``deepspeed.initialize``, a step every ~50 ms.

    torchrun --nproc_per_node=2 deepspeed_train.py

The engine, its optimizer and its scheduler are held only by the training function's locals (as a
script that calls ``train()`` holds them). Prints ``READY <pid> <rank> <local_rank>`` once its first
steps are done; trains until killed.
"""

import os
import sys
import time

import deepspeed
import torch
from torch import nn

CONFIG = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                      "warmup_num_steps": 5, "total_num_steps": 1000000}},
    "zero_optimization": {"stage": 1},
}


def train() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1))
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=CONFIG)
    for step in range(8):
        engine.backward(engine(torch.randn(8, 6)).pow(2).mean())
        engine.step()
    sys.stdout.write("READY %d %s %s\n" % (os.getpid(), os.environ.get("RANK"), os.environ.get("LOCAL_RANK")))
    sys.stdout.flush()
    while True:
        engine.backward(engine(torch.randn(8, 6)).pow(2).mean())
        engine.step()
        time.sleep(0.05)


train()
