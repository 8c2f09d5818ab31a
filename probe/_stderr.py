"""One line to the process's stderr from inside a target or a host helper: never raises, whatever became
of the stream (closed, a broken pipe, a replaced ``sys.stderr``). Stdlib only."""

import sys

__all__ = ["say"]


def say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except BaseException:
        pass
