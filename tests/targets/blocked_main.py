"""A main thread blocked in C (``Event.wait``) until a snippet sets ``release``; then it counts in Python.

``ran_on_main`` collects what snippets put there; ``counter`` proves the main thread runs bytecodes again.
"""

import os
import threading

release = threading.Event()
ran_on_main = []
counter = 0


def main() -> None:
    global counter
    print("READY", os.getpid(), flush=True)
    release.wait()  # blocked in C: no bytecode boundary until it returns
    while True:
        counter += 1


main()
