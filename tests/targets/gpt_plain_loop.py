"""A tiny GPT-2 trained by a hand-written loop: AdamW at a constant lr, no LR scheduler, a global ``step``. Its
AdamW groups the parameters as transformers' Trainer does (decayed, and not: biases and norms), so a Trainer can
resume from a checkpoint of it.

    gpt_plain_loop.py

Prints ``READY <pid>`` after 4 steps, then trains slowly until killed (a checkpoint lands between steps).
"""

import os
import sys
import time

import torch
from transformers import GPT2LMHeadModel
from transformers.trainer_pt_utils import get_parameter_names

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import Tokens, tiny_config  # noqa: E402

torch.manual_seed(3)
lm = GPT2LMHeadModel(tiny_config())
decayed = set(get_parameter_names(lm, [torch.nn.LayerNorm], [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                                              r"_norm(?:$|\.)"]))
adam = torch.optim.AdamW([{"params": [p for n, p in lm.named_parameters() if n in decayed], "weight_decay": 0.0},
                          {"params": [p for n, p in lm.named_parameters() if n not in decayed], "weight_decay": 0.0}],
                         lr=5e-4)
batches = torch.utils.data.DataLoader(Tokens(), batch_size=4)
step = 0
while True:
    for batch in batches:
        lm(**batch).loss.backward()
        adam.step()
        adam.zero_grad()
        step += 1
        if step == 4:
            sys.stdout.write("READY %d\n" % os.getpid())
            sys.stdout.flush()
        time.sleep(0.2)
