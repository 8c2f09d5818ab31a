"""A target that registers its own table, ``myapp.metrics``, through the public ``probe.register_table``."""

import os
import time

import probe

history = [(1, 2.5), (2, 1.25), (3, 0.625)]


def metrics_rows():
    return list(history)


probe.register_table(
    "myapp.metrics",
    [("step", "BIGINT", "Training step."), ("loss", "DOUBLE", "Loss at that step.")],
    metrics_rows,
    "Loss per training step of this toy application.",
)

print("READY", os.getpid(), flush=True)
while True:
    time.sleep(0.2)
