"""A program whose second thread keeps a tuple half built: ``tuple(generator)`` where the generator sleeps
between its items (the GIL free meanwhile), as an import that builds a tuple of modules does
(torch._dynamo's polyfills, imported under Lightning). CPython refuses to finish such a tuple when anything
else holds it, so a scan of the collector's objects that lets this thread run while the scan holds them
all kills the program.

    tuple_builder.py

Prints ``READY <pid>`` once torch is imported and the builder runs. The builder counts its tuples in
``built``; at a SystemError it says so on stderr and the process exits 3.
"""

import os
import sys
import threading
import time

import torch

sys.setswitchinterval(1e-5)  # threads take turns often: a scan that lets them run will
built = 0


def slow_items():
    for item in range(40):
        time.sleep(0.0002)
        yield item


def build() -> None:
    global built
    while True:
        try:
            tuple(slow_items())
        except SystemError as exc:
            sys.stderr.write("builder: %r\n" % (exc,))
            sys.stderr.flush()
            os._exit(3)
        built += 1


threading.Thread(target=build, daemon=True, name="builder").start()
weights = [torch.zeros(3) for _ in range(50)]
print("READY", os.getpid(), flush=True)
while True:
    time.sleep(1)
