"""A target whose main thread holds the GIL in one long C call (the agent cannot answer), with locals of
every simple kind in the frames on its stack, and secrets among them.

``hold`` calls ``sum(range(n))`` (builtin_sum never lets go of the GIL); its caller ``prepare`` holds
the locals a user asks for in such a state: numbers, strings, None, bools, short containers, an object
of a class, and a key and a URL with a password that must not be shown.
"""

import os


class Batch:
    def __init__(self, size: int) -> None:
        self.size = size


def hold(count: int, label: str) -> int:
    print("READY", os.getpid(), flush=True)
    return sum(range(count))  # builtin_sum: keeps the GIL until it returns


def prepare() -> int:
    step = 1234
    lr = 0.003
    name = "resnet-50"
    nothing = None
    done = False
    ready = True
    sizes = [1, 2, 3]
    shape = (8, 16)
    config = {"epochs": 3, "warmup": 0}
    batch = Batch(32)
    api_key = "sk-live-" + "4f9a2b7c1d8e6f3a"
    db_url = "postgres://trainer:" + "hunter2hunter2" + "@db.example.com/runs"
    return hold(10 ** 13, name) + step + len(sizes) + len(shape) + len(config) + batch.size + len(api_key + db_url) \
        + int(lr) + (nothing is None) + done + ready


prepare()
