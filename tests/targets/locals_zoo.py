"""Locals that a careless ``repr`` would choke on, a deep stack, and a ``__repr__`` that blocks.

``main()`` holds them; thread ``deep`` waits 300 frames down. ``Slow.__repr__`` sleeps until a
snippet sets ``let_repr_go``.
"""

import os
import threading

let_repr_go = threading.Event()
parked = threading.Event()


class Slow:
    def __repr__(self) -> str:
        let_repr_go.wait(60)
        return "Slow()"


def recurse(n: int) -> None:
    if n:
        recurse(n - 1)
    else:
        parked.wait()


def main() -> None:
    losses = [0.5, 0.25]
    big = list(range(10_000_000))
    blob = b"x" * (50 << 20)
    text = "y" * 10_000_000
    table = {i: str(i) for i in range(100_000)}
    huge = 10 ** 5000
    slow = Slow()
    threading.Thread(target=recurse, args=(300,), name="deep", daemon=True).start()
    print("READY", os.getpid(), flush=True)
    while True:
        parked.wait(0.1)
    print(losses, big, blob, text, table, huge, slow)


main()
