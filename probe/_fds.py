"""This process's file descriptors, as the code that runs inside a target must treat them: a number is
ours only while the program leaves it (it may close it and open its own file there), so an open file is
known by what it refers to, not by its number. Stdlib only.
"""

import os
from typing import Optional, Tuple

__all__ = ["Identity", "fd_identity", "keep_stdio_open"]

Identity = Tuple[int, int]  # (st_dev, st_ino) of an open file: what a descriptor number refers to


def fd_identity(fd: int) -> Optional[Identity]:
    """What descriptor ``fd`` refers to now, as (st_dev, st_ino); None when it is not open."""
    try:
        info = os.fstat(fd)
    except (OSError, ValueError, OverflowError):
        return None
    return info.st_dev, info.st_ino


def keep_stdio_open() -> None:
    """Where the process started with descriptor 0, 1 or 2 closed, put /dev/null there before the agent
    opens anything: else its socket or crash record would become the program's stdin, stdout or stderr
    (what the program prints would fill the record; a print would go to a client). Each open takes the
    lowest free number, so opening until the number is above 2 fills exactly the holes, without ever
    replacing a descriptor that another thread opened meanwhile. Close-on-exec, as the holes were."""
    for _ in range(3):
        try:
            fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return
        if fd > 2:
            os.close(fd)
            return
