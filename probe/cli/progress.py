"""A progress line on stderr while a fan-out waits, only on a terminal (a pipe or a log gets none)."""

import sys
from typing import List, Optional

from probe.client.fanout import Progress

__all__ = ["progress_line"]


def progress_line() -> Optional[Progress]:
    """A callback that redraws ``probe: 12/64 answered, waiting for ranks 3,5-9``; (-1, ...) clears it."""
    if not sys.stderr.isatty():
        return None
    shown = [False]

    def show(answered: int, total: int, waiting: List[int]) -> None:
        from probe.client.cluster import compact_ranks

        if answered < 0:
            if shown[0]:
                sys.stderr.write("\r\033[K")
                sys.stderr.flush()
            return
        shown[0] = True
        text = "probe: %d/%d answered, waiting for %s" % (answered, total, compact_ranks(waiting)[:60])
        sys.stderr.write("\r\033[K" + text)
        sys.stderr.flush()

    return show
