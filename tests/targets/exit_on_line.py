"""A target that returns from its main function (a normal exit, status 0) when a line arrives on stdin."""

import os
import sys


def main() -> None:
    print("READY", os.getpid(), flush=True)
    sys.stdin.readline()
    print("EXITING", flush=True)


main()
