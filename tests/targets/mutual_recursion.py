"""A busy target without an agent whose stacks change all the time: two functions recurse into each
other (``ping`` -> ``pong`` -> ``ping`` ...) to a depth that changes, and back, in a loop on the CPU;
and, shaped otherwise, thread ``walker``: a method that recurses through generators (``yield from``)
down a tree and back.

Every frame but the innermost is stopped at a call; a read from outside that catches the stack while it
changes can show a frame at a line that calls nothing, or a chain the program cannot make.
"""

import os
import threading


def ping(depth: int, limit: int) -> int:
    total = depth * 3
    total += 1
    if depth < limit:
        total += pong(depth + 1, limit)
    total -= 2
    return total


def pong(depth: int, limit: int) -> int:
    value = depth + 7
    value *= 2
    if depth < limit:
        value += ping(depth + 1, limit)
    value //= 3
    return value


class Tree:
    def __init__(self, depth: int) -> None:
        self.children = [Tree(depth - 1), Tree(depth - 2)] if depth > 1 else []

    def walk(self, level: int):
        yield level
        for child in self.children:
            yield from child.walk(level + 1)
        yield -level


def work() -> None:
    tree = Tree(9)
    while True:
        total = 0
        for value in tree.walk(0):
            total += value


def main() -> None:
    threading.Thread(target=work, name="walker", daemon=True).start()
    print("READY", os.getpid(), flush=True)
    limit = 3
    while True:
        ping(0, limit)
        limit = 3 + (limit + 5) % 17


if __name__ == "__main__":
    main()
